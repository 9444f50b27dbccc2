-- Within one database: queue positions, locking a conversation's endpoint,
-- delivering a message to its receiver's queue or handing it to the
-- transmission queue, and ending a conversation with an error.

-- The trace of the messages a transaction sends: the setting
-- broker.traceparent (SET LOCAL broker.traceparent = '00-...'), NULL when it
-- is not set or empty.  Each message sent takes it when it is queued.
CREATE OR REPLACE FUNCTION broker._traceparent() RETURNS broker.traceparent
LANGUAGE sql STABLE AS $$
    SELECT nullif(current_setting('broker.traceparent', true), '')::broker.traceparent
$$;
GRANT EXECUTE ON FUNCTION broker._traceparent() TO broker_relay;

------------------------------------------------------------------------------
-- Positions
------------------------------------------------------------------------------

-- A commit-ordered position: the writer's transaction id (plus the offset in
-- broker.queue_position_base) in the high bits and a counter within the
-- transaction in the low 20 bits.  Every row with a position below
-- broker.committed_position_horizon() was written by a transaction that has
-- already finished, so a bulk reader that reads up to the horizon never later
-- sees a newly committed position below what it has read (invariant 6).  A
-- transaction may enqueue at most 1,048,575 messages.  n positions: returns
-- the first; the others follow it one by one.  The high bits are read once a
-- transaction and kept beside the counter.
CREATE OR REPLACE FUNCTION broker._next_queue_positions(n integer) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    first integer := coalesce(nullif(current_setting('broker.position_counter', true), ''), '0')::integer + 1;
    high_bits bigint := coalesce(CASE WHEN first > 1
                                      THEN nullif(current_setting('broker.position_high_bits', true), '')::bigint END,
                                 broker._queue_position_now());
BEGIN
    IF first + n - 1 >= 1048576 THEN
        PERFORM broker._raise('BR050', 'a transaction may enqueue at most 1048575 messages');
    END IF;
    PERFORM set_config('broker.position_counter', (first + n - 1)::text, true),
            set_config('broker.position_high_bits', high_bits::text, true);
    RETURN high_bits | first;
END $$;
GRANT EXECUTE ON FUNCTION broker._next_queue_positions(integer) TO broker_relay;

-- One commit-ordered position (see broker._next_queue_positions).
CREATE OR REPLACE FUNCTION broker._next_queue_position() RETURNS bigint
LANGUAGE sql AS $$
    SELECT broker._next_queue_positions(1)
$$;
GRANT EXECUTE ON FUNCTION broker._next_queue_position() TO broker_relay;

-- The high bits of this transaction's positions.
CREATE OR REPLACE FUNCTION broker._queue_position_now() RETURNS bigint
LANGUAGE sql AS $$
    SELECT (pg_current_xact_id()::text::bigint + b.xid_offset) << 20 FROM broker.queue_position_base b
$$;
GRANT EXECUTE ON FUNCTION broker._queue_position_now() TO broker_relay;

CREATE OR REPLACE FUNCTION broker.committed_position_horizon() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT (pg_snapshot_xmin(pg_current_snapshot())::text::bigint + b.xid_offset) << 20
    FROM broker.queue_position_base b
$$;
COMMENT ON FUNCTION broker.committed_position_horizon() IS $$Every row of a queue below this position was written by a
transaction that has finished: a `queue_position` is the writing transaction's id shifted left 20 bits plus a counter,
and this is the oldest transaction still running, in the same units. A bulk reader that reads `queue_position >
checkpoint AND queue_position < broker.committed_position_horizon()` never later finds a newly committed row below its
checkpoint, which a reader of a plain `bigserial` would (a lower id can commit later). See "Committed order for bulk
readers" in the guarantees.$$;

-- The database was restored into a cluster whose transaction ids are behind
-- those its positions were made with (pg_dump and pg_restore into another
-- cluster): new positions would come before earlier ones, and a bulk reader
-- past those would never see them.  Raises the offset added to transaction
-- ids so that every new position comes after every position made so far, and
-- returns what it added: 0, with nothing locked, when they are in order.  It
-- waits (at most 5 s, else lock_not_available) for the transactions that made
-- positions to end, holding new ones back meanwhile.  A running relay calls
-- it when it starts and every minute; it runs as the schema's owner, since it
-- reads the ingests' checkpoints, which the relay's role may not.
CREATE OR REPLACE FUNCTION broker.continue_queue_positions() RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp
AS $$
DECLARE
    added bigint;
BEGIN
    IF broker._highest_queue_position() < broker._queue_position_now() THEN
        RETURN 0;
    END IF;
    PERFORM set_config('lock_timeout', '5s', true);
    LOCK TABLE broker.queue_position_base IN ACCESS EXCLUSIVE MODE;
    -- Past the oldest transaction still running, not this one: one that had its id before the lock (it wrote
    -- something else first) makes its positions after it.
    SELECT greatest((broker._highest_queue_position()
                     - ((pg_snapshot_xmin(pg_current_snapshot())::text::bigint + b.xid_offset) << 20)) >> 20, -1) + 1
    INTO added FROM broker.queue_position_base b;
    UPDATE broker.queue_position_base SET xid_offset = xid_offset + added;
    RETURN added;
END $$;
COMMENT ON FUNCTION broker.continue_queue_positions() IS $$(admin, relay) In a database restored into a cluster whose
transaction ids are behind its own (`pg_restore` into another cluster), makes new queue positions come after every
earlier one by raising the offset in `queue_position_base`, and returns the transaction ids added (0, locking nothing,
when positions are in order). Waits at most 5 s for the transactions that made positions (else SQLSTATE 55P03). A
running relay calls it when it starts and every minute.$$;
GRANT EXECUTE ON FUNCTION broker.continue_queue_positions() TO broker_relay;

-- The highest position a queue, an ingest's checkpoint or a watched head holds.
CREATE OR REPLACE FUNCTION broker._highest_queue_position() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT greatest(max(m.queue_position), (SELECT max(c.queue_position) FROM broker.ingest_checkpoints c),
                    (SELECT max(w.queue_position) FROM broker.watched_heads w), 0)
    FROM broker.queues q
    CROSS JOIN LATERAL (SELECT m.queue_position FROM broker.queue_messages m WHERE m.queue_id = q.queue_id
                        ORDER BY m.queue_position DESC LIMIT 1) m
$$;

------------------------------------------------------------------------------
-- Delivering and transmitting
------------------------------------------------------------------------------

-- Puts a message in the receiver's queue, with a notification on channel
-- broker_queue with the queue's id, which wakes REST readers that wait for it
-- (PostgreSQL sends one per queue per transaction, however many messages it
-- enqueued).  A notice (sequence_number 0) records the last number received
-- from the far side, after which it is received.
CREATE OR REPLACE FUNCTION broker._enqueue(receiver broker.endpoints, sequence_number bigint, message_type_id integer,
                                body bytea, traceparent text DEFAULT NULL)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO broker.queue_messages (queue_id, queue_position, conversation_group_id, conversation_handle,
                                       conversation_id, message_sequence_number, message_type_id, body, notice_after,
                                       priority, traceparent)
    VALUES (receiver.queue_id, broker._next_queue_position(), receiver.conversation_group_id,
            receiver.conversation_handle, receiver.conversation_id, sequence_number, message_type_id, body,
            CASE WHEN sequence_number = 0 THEN receiver.receive_sequence END, receiver.priority, traceparent);
    SELECT pg_notify('broker_queue', receiver.queue_id::text);
$$;
GRANT EXECUTE ON FUNCTION broker._enqueue(broker.endpoints,bigint,integer,bytea,text) TO broker_relay;

-- Locks every local endpoint of a conversation, the initiator's first, and
-- returns the one for the handle.  All writers lock in this order, so two
-- transactions on the two sides of a local conversation cannot deadlock.
CREATE OR REPLACE FUNCTION broker._lock_endpoint(handle uuid) RETURNS broker.endpoints
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints;
    result broker.endpoints;
BEGIN
    FOR e IN
        SELECT * FROM broker.endpoints
        WHERE conversation_id = (SELECT conversation_id FROM broker.endpoints
                                 WHERE conversation_handle = broker._require('conversation_handle', handle))
        ORDER BY is_initiator DESC
        FOR UPDATE
    LOOP
        IF e.conversation_handle = handle THEN
            result := e;
        END IF;
    END LOOP;
    IF result.conversation_handle IS NULL THEN
        PERFORM broker._raise('BR005', format('unknown conversation %s', handle));
    END IF;
    RETURN result;
END $$;
GRANT EXECUTE ON FUNCTION broker._lock_endpoint(uuid) TO broker_relay;

-- The far endpoint of a local conversation, or NULL when the far side is remote.
CREATE OR REPLACE FUNCTION broker._far_endpoint(e broker.endpoints) RETURNS broker.endpoints
LANGUAGE sql STABLE AS $$
    SELECT * FROM broker.endpoints
    WHERE conversation_id = e.conversation_id AND is_initiator <> e.is_initiator
$$;
GRANT EXECUTE ON FUNCTION broker._far_endpoint(broker.endpoints) TO broker_relay;

-- Stores message number sequence_number from the far side at a locked local
-- endpoint, applying what system messages do to its state.  The caller has
-- checked that sequence_number comes next (invariant 3), except that a
-- broker.error may skip numbers (see broker._transmit_error).  traceparent
-- is the message's trace.
CREATE OR REPLACE FUNCTION broker._deliver(receiver broker.endpoints, sequence_number bigint, mt broker.message_types,
                                body bytea, traceparent text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    new_state text := receiver.state;
    visible boolean := receiver.state IN ('conversing', 'disconnected_inbound');
BEGIN
    IF sequence_number <> receiver.receive_sequence + 1
       AND NOT (mt.name = 'broker.error' AND sequence_number > receiver.receive_sequence) THEN
        PERFORM broker._raise('XX000', format('conversation %s expected message %s, got %s',
            receiver.conversation_id, receiver.receive_sequence + 1, sequence_number));
    END IF;
    IF mt.name = 'broker.end_dialog' THEN
        new_state := CASE receiver.state WHEN 'conversing' THEN 'disconnected_inbound'
                                         WHEN 'disconnected_outbound' THEN 'closed'
                                         ELSE receiver.state END;
    ELSIF mt.name = 'broker.error' THEN
        new_state := CASE WHEN receiver.state IN ('conversing', 'disconnected_inbound') THEN 'error'
                          WHEN receiver.state = 'disconnected_outbound' THEN 'closed'
                          ELSE receiver.state END;
    ELSIF mt.name = 'broker.renumbered' THEN  -- the far side went back and numbered past what is here
        PERFORM broker._record_lost_messages(receiver, 'received',
                                             (convert_from(body, 'UTF8')::jsonb ->> 'first_number')::bigint,
                                             (convert_from(body, 'UTF8')::jsonb ->> 'last_number')::bigint,
                                             'renumbered');
    END IF;
    UPDATE broker.endpoints
    SET receive_sequence = sequence_number,
        state = new_state,
        closed_at = CASE WHEN new_state = 'closed' THEN coalesce(closed_at, now()) END,
        timer_at = CASE WHEN new_state = 'closed' THEN NULL ELSE timer_at END
    WHERE conversation_handle = receiver.conversation_handle;
    IF visible THEN
        PERFORM broker._enqueue(receiver, sequence_number, mt.message_type_id, body, traceparent);
    END IF;
END $$;
GRANT EXECUTE ON FUNCTION broker._deliver(broker.endpoints,bigint,broker.message_types,bytea,text) TO broker_relay;

-- Numbers a message from a locked endpoint and hands it to the far side:
-- delivered in this transaction when the far side is local, otherwise put
-- on the transmission queue.  A message with a delivery time to come is held
-- until then, and so is every later message of its side of the conversation
-- while one is held, whatever the far side: each waits in the transmission
-- queue, due at the latest delivery time (held_until) so far.  The relay sends
-- a remote one once it is due; broker._fire_due_events delivers a local one,
-- and forgets held_until when none is left.  Returns the message's sequence
-- number.
CREATE OR REPLACE FUNCTION broker._transmit(sender broker.endpoints, mt broker.message_types, body bytea,
                                 deliver_at timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sequence_number bigint := sender.send_sequence + 1;
    hold_until timestamptz := CASE WHEN deliver_at > clock_timestamp() THEN greatest(deliver_at, sender.held_until)
                                   ELSE sender.held_until END;
    far broker.endpoints;
BEGIN
    UPDATE broker.endpoints e SET send_sequence = sequence_number, held_until = hold_until
    WHERE e.conversation_handle = sender.conversation_handle;
    IF sender.far_is_local AND hold_until IS NULL THEN
        far := broker._far_endpoint(sender);
        PERFORM broker._deliver(far, sequence_number, mt, body, broker._traceparent());
    ELSE
        INSERT INTO broker.transmission_log (conversation_handle, message_sequence_number, conversation_id,
                                             to_service, message_type_id, body, next_attempt_at, priority,
                                             traceparent)
        VALUES (sender.conversation_handle, sequence_number, sender.conversation_id,
                sender.far_service, mt.message_type_id, body, greatest(hold_until, now()), sender.priority,
                broker._traceparent());
        IF NOT sender.far_is_local THEN
            PERFORM pg_notify('broker_transmission_queue', '');
        END IF;
    END IF;
    RETURN sequence_number;
END $$;
GRANT EXECUTE ON FUNCTION broker._transmit(broker.endpoints,broker.message_types,bytea,timestamp with time zone) TO broker_relay;

-- Removes what waits in an endpoint's own queue and marks it closed.
CREATE OR REPLACE FUNCTION broker._close_endpoint(e broker.endpoints) RETURNS void
LANGUAGE sql AS $$
    DELETE FROM broker.queue_messages
    WHERE conversation_group_id = e.conversation_group_id AND conversation_handle = e.conversation_handle;
    UPDATE broker.endpoints SET state = 'closed', closed_at = now(), timer_at = NULL
    WHERE conversation_handle = e.conversation_handle;
$$;
GRANT EXECUTE ON FUNCTION broker._close_endpoint(broker.endpoints) TO broker_relay;

CREATE OR REPLACE FUNCTION broker._error_body(error_code integer, error_description text) RETURNS bytea
LANGUAGE sql IMMUTABLE AS $$
    SELECT convert_to(jsonb_build_object('code', error_code, 'description', error_description)::text, 'UTF8')
$$;
GRANT EXECUTE ON FUNCTION broker._error_body(integer,text) TO broker_relay;

-- Takes out of the transmission log what waits of a conversation side: the
-- numbers its far node has not acknowledged (all of them for a local far
-- side, whose log holds only messages held until their delivery time), and
-- its retry.  What was acknowledged stays for the resend window.
CREATE OR REPLACE FUNCTION broker._take_waiting(handle uuid) RETURNS SETOF broker.transmission_log
LANGUAGE sql AS $$
    WITH retry_ended AS (
        DELETE FROM broker.transmission_retries r WHERE r.conversation_handle = handle
    )
    DELETE FROM broker.transmission_log t
    WHERE t.conversation_handle = handle
      AND t.message_sequence_number > coalesce((SELECT p.acknowledged_sequence FROM broker.transmission_progress p
                                                WHERE p.conversation_handle = handle), 0)
    RETURNING t.*;
$$;
GRANT EXECUTE ON FUNCTION broker._take_waiting(uuid) TO broker_relay;

-- Sends broker.error to the far side of a locked endpoint.  What this side
-- had not transmitted yet is dropped first, as Service Broker does: the far
-- side must not act on work that the error cancels.  The error keeps the next
-- number, and the far side accepts a broker.error across the numbers dropped
-- (it is the last message of its direction: nothing can come into them).
-- Numbering the error into the dropped numbers instead would not do: a
-- dropped message may already be stored at the far node, by a batch whose
-- acknowledgement is still on its way, and the error would be discarded
-- there as a duplicate.
CREATE OR REPLACE FUNCTION broker._transmit_error(sender broker.endpoints, error_code integer, error_description text)
RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._take_waiting(sender.conversation_handle);
    sender.held_until := NULL;  -- what was held is dropped, and the error goes now
    RETURN broker._transmit(sender, broker._message_type('broker.error'),
                            broker._error_body(error_code, error_description));
END $$;
GRANT EXECUTE ON FUNCTION broker._transmit_error(broker.endpoints,integer,text) TO broker_relay;

-- Ends a locked endpoint's conversation because this node cannot go on with it:
-- the local application sees a broker.error notice, the far side a broker.error
-- (sent by broker._transmit_error).
CREATE OR REPLACE FUNCTION broker._fail_conversation(e broker.endpoints, error_code integer, error_description text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    far_state text := (broker._far_endpoint(e)).state;
BEGIN
    IF NOT e.far_is_local OR far_state IN ('conversing', 'disconnected_outbound') THEN
        PERFORM broker._transmit_error(e, error_code, error_description);
    END IF;
    UPDATE broker.endpoints SET state = 'error', timer_at = NULL WHERE conversation_handle = e.conversation_handle;
    PERFORM broker._enqueue(e, 0, (broker._message_type('broker.error')).message_type_id,
                            broker._error_body(error_code, error_description));
END $$;
GRANT EXECUTE ON FUNCTION broker._fail_conversation(broker.endpoints,integer,text) TO broker_relay;
