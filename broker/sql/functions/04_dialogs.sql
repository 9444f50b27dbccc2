-- Beginning and ending a conversation.

------------------------------------------------------------------------------
-- Beginning
------------------------------------------------------------------------------

-- The new conversation joins the group of related_conversation_group, or of
-- the local conversation side related_conversation (Service Broker's
-- RELATED_CONVERSATION), which must be in the initiating service's queue.
CREATE OR REPLACE FUNCTION broker.begin_dialog(from_service text, to_service text, contract text,
                                    lifetime interval DEFAULT NULL, related_conversation_group uuid DEFAULT NULL,
                                    related_conversation uuid DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    initiator_service broker.services := broker._service(from_service);
    dialog_contract integer := broker._contract_id(contract);
    target_service broker.services;
    far_instance uuid;
    conversation uuid := gen_random_uuid();
    handle uuid := gen_random_uuid();
    group_id uuid := coalesce(related_conversation_group, gen_random_uuid());
    group_queue integer;
    target_group uuid := gen_random_uuid();
BEGIN
    IF lifetime <= interval '0' THEN
        PERFORM broker._raise('BR050', format('lifetime must be positive, got %s', lifetime));
    END IF;
    PERFORM broker._settable_time('the end of a lifetime', now() + lifetime);
    IF related_conversation IS NOT NULL THEN
        IF related_conversation_group IS NOT NULL THEN
            PERFORM broker._raise('BR050', 'give related_conversation or related_conversation_group, not both');
        END IF;
        SELECT e.conversation_group_id INTO group_id FROM broker.endpoints e
        WHERE e.conversation_handle = related_conversation;
        IF NOT FOUND THEN
            PERFORM broker._raise('BR005', format('unknown conversation %s', related_conversation));
        END IF;
    END IF;
    SELECT * INTO target_service FROM broker.services WHERE name = broker._require('to_service', to_service);
    IF FOUND THEN
        IF NOT EXISTS (SELECT 1 FROM broker.service_contracts sc
                       WHERE sc.service_id = target_service.service_id AND sc.contract_id = dialog_contract) THEN
            PERFORM broker._raise('BR011', format('service %L does not accept contract %L', to_service, contract));
        END IF;
    ELSE
        SELECT r.broker_instance INTO far_instance FROM broker.routes r WHERE r.service_name = to_service;
        IF NOT FOUND THEN
            PERFORM broker._raise('BR001', format('unknown service %L: no local service and no route by that name', to_service),
                'create the service, or a route to the node that has it');
        END IF;
    END IF;

    SELECT queue_id INTO group_queue FROM broker.conversation_groups WHERE conversation_group_id = group_id;
    IF NOT FOUND THEN
        INSERT INTO broker.conversation_groups VALUES (group_id, initiator_service.queue_id);
    ELSIF group_queue <> initiator_service.queue_id THEN
        PERFORM broker._raise('BR050', format('conversation group %s belongs to another queue', group_id));
    END IF;

    INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                  service_id, queue_id, far_service, far_is_local, far_broker_instance,
                                  contract_id, expires_at, priority)
    VALUES (handle, conversation, true, group_id, initiator_service.service_id, initiator_service.queue_id,
            to_service, target_service.service_id IS NOT NULL, far_instance, dialog_contract, now() + lifetime,
            broker._priority(contract, from_service, to_service));

    IF target_service.service_id IS NOT NULL THEN
        INSERT INTO broker.conversation_groups VALUES (target_group, target_service.queue_id);
        INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                      service_id, queue_id, far_service, far_is_local, contract_id, expires_at,
                                      priority)
        VALUES (gen_random_uuid(), conversation, false, target_group, target_service.service_id,
                target_service.queue_id, from_service, true, dialog_contract, now() + lifetime,
                broker._priority(contract, to_service, from_service));
    END IF;
    RETURN handle;
END $$;
COMMENT ON FUNCTION broker.begin_dialog(text, text, text, interval, uuid, uuid) IS $$Begins a conversation from a
local service to a local or routed service under `contract`, and returns the initiator's conversation handle.
`lifetime`: how long the conversation may last (positive; NULL: for ever). The conversation joins the group given
(`related_conversation_group`), or that of the local conversation side `related_conversation` (Service Broker's
`RELATED_CONVERSATION`), which must be in `from_service`'s queue; else a new group.$$;
GRANT EXECUTE ON FUNCTION broker.begin_dialog(text,text,text,interval,uuid,uuid) TO broker_application;

------------------------------------------------------------------------------
-- Ending
------------------------------------------------------------------------------

-- An error goes to the far side by broker._transmit_error.  Error codes of 0
-- and below are refused: they are the broker's own (-1 an expired lifetime, -2
-- a quarantine, -3 a refusal).
CREATE OR REPLACE FUNCTION broker.end_conversation(conversation_handle uuid, error_code integer DEFAULT NULL,
                                                   error_description text DEFAULT NULL, cleanup boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    e broker.endpoints := broker._lock_endpoint(conversation_handle);
BEGIN
    IF cleanup THEN
        PERFORM broker._take_waiting(e.conversation_handle);
        PERFORM broker._close_endpoint(e);
        RETURN;
    END IF;
    IF (error_code IS NULL) <> (error_description IS NULL) THEN
        PERFORM broker._raise('BR050', 'error_code and error_description go together: give both or neither');
    END IF;
    IF error_code <= 0 THEN
        PERFORM broker._raise('BR050', format('error_code must be positive, got %s', error_code),
            'codes of 0 and below belong to the broker');
    END IF;
    IF length(error_description) > 4000 THEN
        PERFORM broker._raise('BR050', 'error_description must be at most 4000 characters');
    END IF;
    IF e.state IN ('closed', 'disconnected_outbound') THEN
        PERFORM broker._raise('BR020', format('conversation %s is already ended (%s)',
            conversation_handle, replace(e.state, '_', ' ')));
    END IF;
    IF error_code IS NOT NULL AND e.state IN ('conversing', 'disconnected_inbound') THEN
        PERFORM broker._transmit_error(e, error_code, error_description);
        PERFORM broker._close_endpoint(e);
    ELSIF e.state = 'conversing' THEN
        PERFORM broker._transmit(e, broker._message_type('broker.end_dialog'), NULL);
        DELETE FROM broker.queue_messages m
        WHERE m.conversation_group_id = e.conversation_group_id AND m.conversation_handle = e.conversation_handle;
        UPDATE broker.endpoints SET state = 'disconnected_outbound', timer_at = NULL
        WHERE endpoints.conversation_handle = e.conversation_handle;
    ELSIF e.state = 'disconnected_inbound' THEN
        PERFORM broker._transmit(e, broker._message_type('broker.end_dialog'), NULL);
        PERFORM broker._close_endpoint(e);
    ELSE  -- error: the far side is gone already
        PERFORM broker._close_endpoint(e);
    END IF;
END $$;
COMMENT ON FUNCTION broker.end_conversation(uuid, integer, text, boolean) IS $$Ends this side of a conversation:
`broker.end_dialog` goes to the far side; or, with `error_code` (positive: 0 and below are the broker's) and
`error_description`, `broker.error` does, and what has not left the transmission queue is dropped; or, with `cleanup`,
nothing goes (what waits to be sent is dropped) and the side is closed at once. BR020 when it is ended already.$$;
GRANT EXECUTE ON FUNCTION broker.end_conversation(uuid,integer,text,boolean) TO broker_application;
