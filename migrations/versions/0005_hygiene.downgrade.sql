-- Removes what revision 0005 added and puts back revision 0002's broker._accept_conversation.
DROP VIEW broker.endpoint_counts;
DROP TRIGGER forget_on_acknowledgement ON broker.transmission_queue;
DROP TRIGGER forget_on_close ON broker.endpoints;
DROP FUNCTION broker._forget_on_close();
DROP FUNCTION broker.forget_closed_endpoints(integer);
DROP TABLE broker.forgotten_conversations;
DROP INDEX broker.endpoints_closed;
ALTER TABLE broker.node DROP COLUMN closed_endpoint_retention, DROP COLUMN tombstone_retention;

CREATE OR REPLACE FUNCTION broker._accept_conversation(from_instance uuid, header jsonb) RETURNS jsonb
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
