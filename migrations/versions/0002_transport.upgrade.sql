-- Between nodes: accepting a transport batch, and the relay's side (building
-- batches, applying acknowledgements, recording failures).  Frozen with revision 0002.

------------------------------------------------------------------------------
-- Receiving side
------------------------------------------------------------------------------

-- The target endpoint of a conversation whose first message arrives from
-- another node.  Raises BR001/BR003/BR011 when the conversation is refused.
CREATE FUNCTION broker._create_target_endpoint(from_instance uuid, header jsonb) RETURNS broker.endpoints
LANGUAGE plpgsql AS $$
DECLARE
    target_service broker.services := broker._service(header ->> 'to_service');
    dialog_contract integer := broker._contract_id(header ->> 'contract');
    group_id uuid := gen_random_uuid();
    e broker.endpoints;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM broker.service_contracts sc
                   WHERE sc.service_id = target_service.service_id AND sc.contract_id = dialog_contract) THEN
        PERFORM broker._raise('BR011', format('service %L does not accept contract %L',
            target_service.name, header ->> 'contract'));
    END IF;
    INSERT INTO broker.conversation_groups VALUES (group_id, target_service.queue_id);
    INSERT INTO broker.endpoints (conversation_handle, conversation_id, is_initiator, conversation_group_id,
                                  service_id, queue_id, far_service, far_is_local, far_broker_instance,
                                  contract_id, expires_at)
    VALUES (gen_random_uuid(), (header ->> 'conversation_id')::uuid, false, group_id, target_service.service_id,
            target_service.queue_id, broker._check_name('service', header ->> 'from_service'), false,
            from_instance, dialog_contract, (header ->> 'expires_at')::timestamptz)
    RETURNING * INTO e;
    RETURN e;
END $$;

-- Stores the messages of one conversation that come next (invariant 3):
-- duplicates are skipped, a gap stops the conversation's batch.
CREATE FUNCTION broker._accept_messages(e broker.endpoints, messages jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    message jsonb;
    sequence_number bigint;
    mt broker.message_types;
    body bytea;
BEGIN
    IF NOT (SELECT is_enabled FROM broker.queues WHERE queue_id = e.queue_id) THEN
        PERFORM broker._raise('BR030', 'the target queue is disabled');
    END IF;
    FOR message IN SELECT value FROM jsonb_array_elements(messages) ORDER BY (value ->> 'sequence_number')::bigint LOOP
        sequence_number := (message ->> 'sequence_number')::bigint;
        CONTINUE WHEN sequence_number <= e.receive_sequence;
        EXIT WHEN sequence_number > e.receive_sequence + 1;
        mt := broker._message_type(message ->> 'message_type');
        body := decode(message ->> 'body', 'base64');
        IF mt.name NOT LIKE 'broker.%' THEN
            PERFORM broker._check_message(e.contract_id, NOT e.is_initiator, mt, body);
        END IF;
        PERFORM broker._deliver(e, sequence_number, mt, body);
        SELECT * INTO e FROM broker.endpoints WHERE conversation_handle = e.conversation_handle;
    END LOOP;
    RETURN e.receive_sequence;
END $$;

-- One conversation of a batch, in a subtransaction of its own so that a bad
-- conversation never spoils the rest.  The result acknowledges the highest
-- number held without a gap, and says why anything was refused.
CREATE FUNCTION broker._accept_conversation(from_instance uuid, header jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    conversation uuid;
    sender_is_initiator boolean;
    e broker.endpoints;
    result jsonb;
    failed_sqlstate text;
    failure text;
BEGIN
    conversation := broker._require('conversation_id', (header ->> 'conversation_id')::uuid);
    sender_is_initiator := broker._require('sender_is_initiator', (header ->> 'sender_is_initiator')::boolean);
    result := jsonb_build_object('conversation_id', conversation, 'sender_is_initiator', sender_is_initiator);
    BEGIN
        SELECT * INTO e FROM broker.endpoints
        WHERE conversation_id = conversation AND is_initiator = NOT sender_is_initiator
        FOR UPDATE;
        IF NOT FOUND AND sender_is_initiator THEN
            e := broker._create_target_endpoint(from_instance, header);
        ELSIF NOT FOUND OR e.far_is_local OR e.far_broker_instance IS DISTINCT FROM from_instance THEN
            PERFORM broker._raise('BR005', format('unknown conversation %s', conversation));
        END IF;
        RETURN result || jsonb_build_object('acknowledged', broker._accept_messages(e, header -> 'messages'));
    EXCEPTION WHEN SQLSTATE 'BR030' THEN
        RETURN result || jsonb_build_object('acknowledged', coalesce(e.receive_sequence, 0), 'waiting', SQLERRM);
    WHEN OTHERS THEN
        failed_sqlstate := SQLSTATE;
        failure := SQLERRM;
        IF failed_sqlstate NOT LIKE 'BR%' AND failed_sqlstate NOT IN ('22P02', '22023', '22007', '22008') THEN
            RAISE;  -- not the conversation's fault: fail the batch, the sender retries
        END IF;
    END;
    -- Refused: end this side too, if it exists, so both sides see broker.error.
    SELECT * INTO e FROM broker.endpoints WHERE conversation_id = conversation AND is_initiator = NOT sender_is_initiator;
    IF FOUND AND e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        e := broker._lock_endpoint(e.conversation_handle);
        PERFORM broker._fail_conversation(e, -3, 'the conversation was refused: ' || failure);
    END IF;
    RETURN result || jsonb_build_object('acknowledged', coalesce(e.receive_sequence, 0),
                                        'refused', jsonb_build_object('sqlstate', failed_sqlstate, 'reason', failure));
END $$;

CREATE FUNCTION broker.accept_transport_batch(from_instance uuid, batch jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    results jsonb := '[]';
    header jsonb;
BEGIN
    IF jsonb_typeof(batch -> 'conversations') IS DISTINCT FROM 'array' THEN
        PERFORM broker._raise('BR050', 'a transport batch is {"conversations": [...]}');
    END IF;
    FOR header IN SELECT value FROM jsonb_array_elements(batch -> 'conversations') LOOP
        results := results || broker._accept_conversation(from_instance, header);
    END LOOP;
    RETURN jsonb_build_object('broker_instance', (SELECT broker_instance FROM broker.node), 'results', results);
END $$;
COMMENT ON FUNCTION broker.accept_transport_batch(uuid, jsonb) IS
    'Stores what comes next of each conversation in a batch from another node; returns the acknowledgements.';

------------------------------------------------------------------------------
-- Sending side (the relay)
------------------------------------------------------------------------------

-- Destinations with messages due for transmission, with what the relay needs to reach them.
CREATE VIEW broker.transport_destinations AS
SELECT r.address, r.broker_instance, min(r.peer_secret) AS peer_secret, min(t.next_attempt_at) AS next_attempt_at,
       count(*) AS waiting
FROM broker.transmission_queue t
JOIN broker.routes r ON r.service_name = t.to_service
GROUP BY r.address, r.broker_instance;

-- The next batch for a destination: the lowest waiting numbers of its conversations.
CREATE FUNCTION broker.transport_batch(destination text, max_messages integer) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    WITH due AS (
        SELECT t.* FROM broker.transmission_queue t
        JOIN broker.routes r ON r.service_name = t.to_service
        WHERE r.address = destination AND t.next_attempt_at <= now()
        ORDER BY t.conversation_handle, t.message_sequence_number
        LIMIT max_messages
    ), conversations AS (
        SELECT jsonb_build_object(
                   'conversation_id', e.conversation_id,
                   'sender_is_initiator', e.is_initiator,
                   'from_service', s.name,
                   'to_service', e.far_service,
                   'contract', c.name,
                   'expires_at', e.expires_at,
                   'messages', jsonb_agg(jsonb_build_object(
                       'sequence_number', due.message_sequence_number,
                       'message_type', mt.name,
                       'body', encode(due.body, 'base64')) ORDER BY due.message_sequence_number)) AS conversation
        FROM due
        JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle
        JOIN broker.services s ON s.service_id = e.service_id
        JOIN broker.contracts c ON c.contract_id = e.contract_id
        JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id
        GROUP BY e.conversation_handle, e.conversation_id, e.is_initiator, s.name, e.far_service, c.name, e.expires_at
    )
    SELECT jsonb_build_object('conversations', coalesce(jsonb_agg(conversation), '[]')) FROM conversations
$$;

-- The far node refused a conversation: it ends here with a broker.error
-- notice; nothing more is sent.
CREATE FUNCTION broker._refused_by_far_side(e broker.endpoints, reason text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_queue WHERE conversation_handle = e.conversation_handle;
    IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
        PERFORM broker._enqueue(e, 0, (broker._message_type('broker.error')).message_type_id,
                                broker._error_body(-3, 'the far node refused the conversation: ' || reason));
    END IF;
END $$;

-- Applies a destination node's answer in one transaction: deletes what it
-- acknowledged, ends what it refused.  Returns how many messages were delivered.
CREATE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    result jsonb;
    e broker.endpoints;
    delivered bigint := 0;
    removed bigint;
BEGIN
    FOR result IN SELECT value FROM jsonb_array_elements(answer -> 'results') LOOP
        SELECT * INTO e FROM broker.endpoints
        WHERE conversation_id = (result ->> 'conversation_id')::uuid
          AND is_initiator = (result ->> 'sender_is_initiator')::boolean
          AND NOT far_is_local;
        CONTINUE WHEN NOT FOUND;
        DELETE FROM broker.transmission_queue
        WHERE conversation_handle = e.conversation_handle
          AND message_sequence_number <= (result ->> 'acknowledged')::bigint;
        GET DIAGNOSTICS removed = ROW_COUNT;
        delivered := delivered + removed;
        IF result ? 'refused' THEN
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(e.conversation_handle),
                                                result -> 'refused' ->> 'reason');
        ELSIF result ? 'waiting' THEN
            UPDATE broker.transmission_queue
            SET transmission_status = 'the far node holds it back: ' || (result ->> 'waiting'),
                attempts = attempts + 1, next_attempt_at = now() + interval '5 seconds'
            WHERE conversation_handle = e.conversation_handle;
        ELSE  -- the far node answered for it: earlier failures no longer apply
            UPDATE broker.transmission_queue
            SET attempts = 0, transmission_status = 'sent; waiting for the numbers before it to be acknowledged'
            WHERE conversation_handle = e.conversation_handle AND attempts > 0;
        END IF;
    END LOOP;
    RETURN delivered;
END $$;

-- A destination could not be reached: every message waiting for it gets the
-- reason in words and its next attempt after the relay's back-off.
CREATE FUNCTION broker.record_transport_failure(destination text, reason text, retry_after interval) RETURNS void
LANGUAGE sql AS $$
    UPDATE broker.transmission_queue t
    SET attempts = t.attempts + 1,
        next_attempt_at = now() + retry_after,
        transmission_status = format('%s (attempt %s, next at %s)', reason, t.attempts + 1,
                                     to_char(now() + retry_after, 'YYYY-MM-DD HH24:MI:SS TZ'))
    FROM broker.routes r
    WHERE r.service_name = t.to_service AND r.address = destination
$$;
