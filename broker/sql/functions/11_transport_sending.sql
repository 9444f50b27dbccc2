-- Between nodes, the sending side: the relay's batches, the answers applied
-- to them (healing a far node or this one gone back to an earlier point), and
-- transmission failures.

------------------------------------------------------------------------------
-- Sending side
------------------------------------------------------------------------------

-- The next batch for a destination, as rows of broker.wire_message for
-- COPY, for the conversations whose handles fall in [first_handle,
-- last_handle]: a relay splits the conversations among lanes that send at
-- once.  The waiting messages are read service by service and priority by
-- priority in the order of the primary key, up to max_messages each, and the
-- first max_messages of those, the highest priority first, are taken, rather
-- than all of them sorted: a long
-- queue costs a batch no more than a short one, and messages waiting for
-- other destinations (a peer down for days) are not read at all, nor those
-- whose conversations wait for a retry after a failure.  The
-- batch is cut where its bodies and headers reach max_bytes.  The first
-- message always goes, whatever its size, so that a message at the size limit
-- still travels alone.  A message's share is its body and the texts that
-- travel with it (its traceparent among them), plus 100 bytes for the
-- fixed-size fields and lengths of its row in the binary COPY format.  The
-- numbers taken are recorded in broker.transmission_progress, in the relay's
-- transaction that commits before the batch leaves.
CREATE OR REPLACE FUNCTION broker.next_batch(destination text, max_messages integer, max_bytes bigint,
                                             first_handle uuid, last_handle uuid)
RETURNS SETOF broker.wire_message
LANGUAGE plpgsql AS $$
DECLARE  -- conversations held back after a failure: seldom any, so each message is looked at only then
    holds_back boolean := EXISTS (SELECT 1 FROM broker.transmission_failures f
                                  WHERE f.address = destination AND f.next_attempt_at > now());
BEGIN  -- plpgsql rather than sql: the plan is kept between batches, not made again for each
    RETURN QUERY
    WITH batch AS (
        SELECT sized.*
        FROM (SELECT due.conversation_handle, e.conversation_id, e.is_initiator, s.name AS from_service,
                     e.far_service AS to_service, c.name AS contract, e.expires_at,
                     due.message_sequence_number AS sequence_number, due.message_id, mt.name AS message_type,
                     due.body, due.traceparent,
                     sum(100 + coalesce(octet_length(due.body), 0) + octet_length(s.name)
                         + octet_length(e.far_service) + octet_length(c.name) + octet_length(mt.name)
                         + coalesce(octet_length(due.traceparent), 0))
                         OVER (ORDER BY due.priority DESC, due.conversation_handle, due.message_sequence_number)
                         AS bytes_so_far,
                     row_number() OVER (ORDER BY due.priority DESC, due.conversation_handle,
                                                 due.message_sequence_number) AS place
              FROM (SELECT t.* FROM broker.routes r, generate_series(10, 1, -1) AS p(priority),
                         LATERAL (SELECT t.* FROM broker.transmission_queue t
                                  WHERE t.to_service = r.service_name AND t.priority = p.priority
                                    AND t.conversation_handle BETWEEN first_handle AND last_handle
                                    AND t.next_attempt_at <= now()
                                    AND (NOT holds_back
                                         OR NOT EXISTS (SELECT 1 FROM broker.transmission_failures f
                                                        WHERE f.address = destination AND f.next_attempt_at > now()
                                                          AND t.conversation_handle
                                                              BETWEEN f.first_handle AND f.last_handle))
                                  ORDER BY t.conversation_handle, t.message_sequence_number
                                  LIMIT max_messages) t
                    WHERE r.address = destination
                    ORDER BY t.priority DESC, t.conversation_handle, t.message_sequence_number
                    LIMIT max_messages) due
              JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle AND NOT e.far_is_local
              JOIN broker.services s ON s.service_id = e.service_id
              JOIN broker.contracts c ON c.contract_id = e.contract_id
              JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id) sized
        WHERE sized.place = 1 OR sized.bytes_so_far <= max_bytes
    ), recorded AS (
        INSERT INTO broker.transmission_progress AS p (conversation_handle, transmitted_sequence)
        SELECT b.conversation_handle, max(b.sequence_number) FROM batch b GROUP BY b.conversation_handle
        ON CONFLICT (conversation_handle) DO UPDATE
        SET previously_transmitted = p.transmitted_sequence,
            transmitted_sequence = greatest(p.transmitted_sequence, excluded.transmitted_sequence)
    )
    SELECT b.conversation_id, b.is_initiator, b.from_service, b.to_service, b.contract, b.expires_at,
           b.sequence_number, b.message_id, b.message_type, b.body, b.traceparent
    FROM batch b
    ORDER BY b.place;
END $$;
COMMENT ON FUNCTION broker.next_batch(text, integer, bigint, uuid, uuid) IS
    'The next batch for a destination: the lowest waiting numbers of its conversations between the handles, up to a count and a size.';
GRANT EXECUTE ON FUNCTION broker.next_batch(text,integer,bigint,uuid,uuid) TO broker_relay;

-- The next batch as rows of broker.transport_message (wire version 3), as the
-- relay of the release before revision 0035 reads it: those nodes serve a
-- database migrated ahead of them until they are replaced.
CREATE OR REPLACE FUNCTION broker.transport_batch(destination text, max_messages integer, max_bytes bigint,
                                                  first_handle uuid, last_handle uuid)
RETURNS SETOF broker.transport_message
LANGUAGE sql AS $$
    SELECT b.conversation_id, b.sender_is_initiator, b.from_service, b.to_service, b.contract, b.expires_at,
           b.sequence_number, b.message_type, b.body, b.traceparent
    FROM broker.next_batch(destination, max_messages, max_bytes, first_handle, last_handle) b;
$$;
COMMENT ON FUNCTION broker.transport_batch(text, integer, bigint, uuid, uuid) IS
    'broker.next_batch without message ids (wire version 3), for a relay of the release before revision 0035.';
GRANT EXECUTE ON FUNCTION broker.transport_batch(text,integer,bigint,uuid,uuid) TO broker_relay;

-- Applies a destination node's answer in one transaction: deletes what it
-- acknowledged (keeping it for broker.node.resend_window), ends what it
-- refused.  Returns how many messages were delivered.  Every acknowledgement
-- is applied by one DELETE and one UPDATE; refusals and hold-backs are rare and
-- handled one by one.  The transaction that applies an answer commits without
-- waiting for its WAL to reach the disk: if a crash loses it, the messages it
-- deleted are sent again and the far node acknowledges them as duplicates
-- (guarantee 3), so the relay need not wait for a flush in every cycle.
--
-- The answer is held to the batch it answers: the relay passes the highest
-- number the batch carried of each conversation side it carried
-- (sent_conversations, sent_by_initiator and last_sent, in step), and only the
-- results for those apply, each acknowledging at most that number.  So no
-- answer, however it is signed, acknowledges, refuses or holds back a message
-- it was not sent.  A result without a number acknowledges nothing.
--
-- Every result says what the far node held before the batch came (held; a
-- node of the release before revision 0035 leaves it out of a result that
-- waits, whose acknowledged is then what it held), and the id of the message
-- it holds under that number (held_message_id, when it knows one).  A database
-- that went back to an earlier point shows there (see
-- broker.transmission_progress): a far node that acknowledges less than it did
-- before lost what it had acknowledged, and gets it again
-- (broker._send_again); one that held less than it had acknowledged before
-- the batch came lost what the batch gave it again (a probe, see
-- broker._probe); a far node that held, before the batch came, numbers this
-- side had not transmitted yet, or beyond what it acknowledged a message that
-- is not the one this side numbered so, or that acknowledges more than this
-- side ever numbered, holds what this side numbered before its database went
-- back, and this side's messages are numbered past them
-- (broker._number_past): nothing of that answer is taken as acknowledged.  A
-- far node that lost what it had acknowledged may
-- have lost as much of conversations that have nothing to send: each of its
-- conversations is probed, at most once a minute (broker.far_node_checks).
CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb, sent_conversations uuid[],
                                                           sent_by_initiator boolean[], last_sent bigint[])
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    handles uuid[];
    services text[];
    priorities smallint[];
    acknowledged bigint[];
    reported bigint[];
    held bigint[];
    held_ids uuid[];
    refusals text[];
    holds text[];
    result record;
    went_back uuid[] := '{}';
    sent_again uuid[] := '{}';
    far_node_lost boolean := false;
    delivered bigint;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    WITH sent AS (
        SELECT * FROM unnest(sent_conversations, sent_by_initiator, last_sent)
                      AS s(conversation_id, sender_is_initiator, last_sent)
    )
    SELECT array_agg(e.conversation_handle), array_agg(e.far_service), array_agg(e.priority),
           array_agg(least(coalesce(r.acknowledged, 0), s.last_sent)), array_agg(r.acknowledged),
           array_agg(coalesce(r.held, CASE WHEN r.waiting IS NOT NULL THEN r.acknowledged END)),
           array_agg(r.held_message_id),
           array_agg(CASE WHEN r.refused IS NOT NULL
                          THEN coalesce(r.refused ->> 'reason', 'no reason given') END),
           array_agg(r.waiting)
    INTO handles, services, priorities, acknowledged, reported, held, held_ids, refusals, holds
    FROM jsonb_to_recordset(answer -> 'results')
         AS r(conversation_id uuid, sender_is_initiator boolean, acknowledged bigint, held bigint,
              held_message_id uuid, refused jsonb, waiting text)
    JOIN sent s ON s.conversation_id = r.conversation_id AND s.sender_is_initiator = r.sender_is_initiator
    JOIN broker.endpoints e ON e.conversation_id = s.conversation_id AND e.is_initiator = s.sender_is_initiator
                           AND NOT e.far_is_local;

    INSERT INTO broker.peer_retention AS p (broker_instance, tombstone_retention)
    SELECT e.far_broker_instance, make_interval(secs => (answer ->> 'tombstone_retention_s')::float8)
    FROM broker.endpoints e
    WHERE e.conversation_handle = handles[1] AND answer ? 'tombstone_retention_s'
    ON CONFLICT (broker_instance) DO UPDATE
    SET tombstone_retention = excluded.tombstone_retention, learned_at = excluded.learned_at
    WHERE p.tombstone_retention <> excluded.tombstone_retention;

    -- A side that ended here may have been acknowledged by a far node that
    -- had forgotten the conversation (held only what it received before), so
    -- held is compared only while this side converses.
    FOR result IN
        SELECT a.conversation_handle, a.reported, a.held, p.previously_transmitted, p.answered_sequence,
               p.acknowledged_sequence, e.send_sequence
        FROM unnest(handles, reported, held, held_ids) AS a(conversation_handle, reported, held, held_id)
        JOIN broker.transmission_progress p ON p.conversation_handle = a.conversation_handle
        JOIN broker.endpoints e ON e.conversation_handle = a.conversation_handle
        WHERE a.reported < p.acknowledged_sequence OR a.held > p.previously_transmitted
           OR a.reported > e.send_sequence
           OR (a.held < p.acknowledged_sequence AND e.state IN ('conversing', 'disconnected_outbound'))
           OR (a.held > p.acknowledged_sequence AND a.held_id IS NOT NULL
               AND EXISTS (SELECT 1 FROM broker.transmission_queue t
                           WHERE t.to_service = e.far_service AND t.priority = e.priority
                             AND t.conversation_handle = e.conversation_handle
                             AND t.message_sequence_number = a.held
                             AND t.message_id IS DISTINCT FROM a.held_id))
    LOOP
        IF result.reported < result.acknowledged_sequence THEN
            far_node_lost := true;
            went_back := went_back || result.conversation_handle;
            IF broker._send_again(result.conversation_handle, result.reported, result.acknowledged_sequence) THEN
                sent_again := sent_again || result.conversation_handle;
            END IF;
        ELSIF result.held < result.acknowledged_sequence AND result.held <= result.previously_transmitted
              AND result.reported <= result.send_sequence THEN
            -- It lost numbers it had acknowledged, and took them again from this batch.
            far_node_lost := true;
            PERFORM broker._record_lost_messages(e, 'sent', result.held + 1, result.acknowledged_sequence, 'resent')
            FROM broker.endpoints e WHERE e.conversation_handle = result.conversation_handle;
        ELSE  -- what the far node holds past answered_sequence may be of this side's numbering before it went back
            went_back := went_back || result.conversation_handle;
            PERFORM broker._number_past(result.conversation_handle, greatest(result.reported, result.held),
                                        least(result.answered_sequence, greatest(result.reported, result.held) - 1));
        END IF;
    END LOOP;
    IF far_node_lost THEN
        PERFORM broker._probe_far_node(e.far_broker_instance)
        FROM broker.endpoints e WHERE e.conversation_handle = handles[1];
    END IF;

    -- The acknowledged rows are found conversation by conversation through the
    -- primary key (OFFSET 0 keeps the planner from making the lateral subquery
    -- a join), then deleted where they lie, and kept for the resend window.  As
    -- a join, the plan could scan the whole transmission queue for every
    -- answer: a long queue (a peer down for days) would make every batch
    -- slower.  A row that another transaction changed meanwhile is not
    -- deleted: it is sent again, and acknowledged as a duplicate.  Nothing is
    -- deleted of a conversation whose answer showed a database that went back:
    -- what that answer acknowledges is not what this side sent.
    WITH acknowledged_rows AS (
        SELECT d.ctid
        FROM unnest(handles, services, priorities, acknowledged)
                 AS a(conversation_handle, to_service, priority, acknowledged),
             LATERAL (SELECT t.ctid FROM broker.transmission_queue t
                      WHERE t.to_service = a.to_service AND t.priority = a.priority
                        AND t.conversation_handle = a.conversation_handle
                        AND t.message_sequence_number <= a.acknowledged
                      OFFSET 0) d
        WHERE a.conversation_handle <> ALL (went_back)
    ), removed AS (
        DELETE FROM broker.transmission_queue t
        WHERE t.ctid = ANY (ARRAY(SELECT r.ctid FROM acknowledged_rows r))
        RETURNING t.*
    ), kept AS (
        INSERT INTO broker.acknowledged_messages (conversation_handle, message_sequence_number, message_type_id,
                                                  body, enqueued_at, traceparent, message_id)
        SELECT r.conversation_handle, r.message_sequence_number, r.message_type_id, r.body, r.enqueued_at,
               r.traceparent, r.message_id
        FROM removed r
        WHERE (SELECT n.resend_window > interval '0' FROM broker.node n)
    )
    SELECT count(*) INTO delivered FROM removed;
    UPDATE broker.transmission_progress p
    SET acknowledged_sequence = greatest(p.acknowledged_sequence, a.acknowledged),
        answered_sequence = p.transmitted_sequence
    FROM unnest(handles, acknowledged) AS a(conversation_handle, acknowledged)
    WHERE p.conversation_handle = a.conversation_handle AND a.conversation_handle <> ALL (went_back);
    -- The far node answered for these: earlier failures no longer apply.
    DELETE FROM broker.transmission_failures f
    WHERE f.next_attempt_at <= now()
      AND f.address IN (SELECT r.address FROM broker.routes r WHERE r.service_name = ANY (services))
      AND EXISTS (SELECT 1 FROM unnest(handles) h WHERE h BETWEEN f.first_handle AND f.last_handle);
    UPDATE broker.transmission_queue t
    SET attempts = 0, transmission_status = 'sent; waiting for the numbers before it to be acknowledged'
    FROM unnest(handles, refusals, holds) AS a(conversation_handle, refused, waiting)
    WHERE t.conversation_handle = a.conversation_handle AND a.refused IS NULL AND a.waiting IS NULL
      AND t.attempts > 0;

    -- A conversation held back is tried again after a back-off that doubles
    -- with each attempt, from a quarter of a second up to a minute.
    FOR result IN
        SELECT * FROM unnest(handles, services, priorities, refusals, holds)
                 AS a(conversation_handle, to_service, priority, refused, waiting)
        WHERE (a.refused IS NOT NULL OR a.waiting IS NOT NULL) AND a.conversation_handle <> ALL (sent_again)
    LOOP
        IF result.refused IS NOT NULL THEN
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(result.conversation_handle), result.refused);
        ELSE
            UPDATE broker.transmission_queue
            SET transmission_status = 'the far node holds it back: ' || result.waiting,
                attempts = attempts + 1,
                next_attempt_at = now() + least(interval '60 seconds', interval '250 milliseconds' * 2 ^ attempts)
            WHERE to_service = result.to_service AND priority = result.priority
              AND conversation_handle = result.conversation_handle;
        END IF;
    END LOOP;
    RETURN delivered;
END $$;
GRANT EXECUTE ON FUNCTION broker.apply_transport_results(jsonb, uuid[], boolean[], bigint[]) TO broker_relay;

-- The answer applied to the batch in pg_temp.sent_transport_batch, as the
-- relay of a release before revision 0031 copies it there: those nodes serve
-- a database migrated ahead of them until they are replaced.
CREATE OR REPLACE FUNCTION broker.apply_transport_results(answer jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sides record;
BEGIN
    SELECT array_agg(b.conversation_id) AS conversations, array_agg(b.sender_is_initiator) AS by_initiator,
           array_agg(b.last_sent) AS last_sent
    INTO sides
    FROM (SELECT conversation_id, sender_is_initiator, max(sequence_number) AS last_sent
          FROM pg_temp.sent_transport_batch
          GROUP BY conversation_id, sender_is_initiator) b;
    RETURN broker.apply_transport_results(answer, sides.conversations, sides.by_initiator, sides.last_sent);
END $$;
GRANT EXECUTE ON FUNCTION broker.apply_transport_results(jsonb) TO broker_relay;

-- The far node lost the numbers after held up to acknowledged of a
-- conversation side's messages, which it had acknowledged: its database went
-- back to an earlier point.  They go to the transmission queue again, from the
-- resend window (broker.acknowledged_messages), in order and before the
-- messages that wait.  When the window no longer holds them all, the
-- conversation ends with broker.error code -4 on both sides (the far node
-- takes the error across the numbers it lacks).  Either way the loss is
-- recorded in broker.lost_messages.  Returns whether they were sent again.
CREATE OR REPLACE FUNCTION broker._send_again(handle uuid, held bigint, acknowledged bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints;
    resent boolean;
BEGIN
    SELECT * INTO e FROM broker.endpoints WHERE conversation_handle = handle FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;  -- an application holds the conversation: the next answer finds the same
    END IF;
    resent := (SELECT count(*) FROM broker.acknowledged_messages k
               WHERE k.conversation_handle = handle AND k.message_sequence_number BETWEEN held + 1 AND acknowledged)
              + (SELECT count(*) FROM broker.transmission_queue t  -- a probe (broker._probe)
                 WHERE t.to_service = e.far_service AND t.priority = e.priority AND t.conversation_handle = handle
                   AND t.message_sequence_number BETWEEN held + 1 AND acknowledged)
              = acknowledged - held;
    IF resent THEN
        WITH taken_back AS (
            DELETE FROM broker.acknowledged_messages k
            WHERE k.conversation_handle = handle AND k.message_sequence_number BETWEEN held + 1 AND acknowledged
            RETURNING k.*
        )
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, enqueued_at, transmission_status,
                                               priority, traceparent, message_id)
        SELECT handle, k.message_sequence_number, e.conversation_id, e.far_service, k.message_type_id, k.body,
               k.enqueued_at, format('sent again: the far node lost it (its database went back to number %s)', held),
               e.priority, k.traceparent, k.message_id
        FROM taken_back k;
    ELSIF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        PERFORM broker._fail_conversation(e, -4, format(
            'messages %s to %s of this conversation were lost: the far node''s database went back to an earlier '
            'point, and this node no longer keeps them (broker.node.resend_window)', held + 1, acknowledged));
    END IF;
    UPDATE broker.transmission_progress SET acknowledged_sequence = held WHERE conversation_handle = handle;
    PERFORM broker._record_lost_messages(e, 'sent', held + 1, acknowledged,
                                         CASE WHEN resent THEN 'resent' ELSE 'lost' END);
    RETURN resent;
END $$;
GRANT EXECUTE ON FUNCTION broker._send_again(uuid,bigint,bigint) TO broker_relay;

-- Asks the far node whether it still holds what it acknowledged of these
-- conversation sides: the highest number it acknowledged of each goes again,
-- from the resend window, unless something of the conversation waits to be
-- sent (the next batch asks then).  A far node that holds it acknowledges it
-- as a duplicate; one that went back to an earlier point takes it again, or
-- asks for the numbers it lacks (broker.apply_transport_results).  Only sides
-- that converse are asked.  A question is enqueued now, not when its message
-- first was: it has not waited (broker.withhold_what_peers_forgot, the
-- backlog's age).  Returns how many were asked.
CREATE OR REPLACE FUNCTION broker._probe(handles uuid[]) RETURNS integer
LANGUAGE sql AS $$
    WITH asked_of AS (
        SELECT k.ctid AS kept
        FROM broker.transmission_progress p
        JOIN broker.endpoints e ON e.conversation_handle = p.conversation_handle
        JOIN broker.acknowledged_messages k ON k.conversation_handle = p.conversation_handle
                                           AND k.message_sequence_number = p.acknowledged_sequence
        WHERE p.conversation_handle = ANY (handles)
          AND e.state IN ('conversing', 'disconnected_outbound') AND NOT e.far_is_local
          AND NOT EXISTS (SELECT 1 FROM broker.transmission_queue t
                          WHERE t.to_service = e.far_service AND t.priority = e.priority
                            AND t.conversation_handle = e.conversation_handle)
        FOR UPDATE OF k SKIP LOCKED  -- another lane sends it again or asks already
    ), taken AS (
        DELETE FROM broker.acknowledged_messages k WHERE k.ctid = ANY (ARRAY(SELECT a.kept FROM asked_of a))
        RETURNING k.*
    ), asked AS (
        INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id,
                                               to_service, message_type_id, body, transmission_status, priority,
                                               traceparent, message_id)
        SELECT k.conversation_handle, k.message_sequence_number, e.conversation_id, e.far_service, k.message_type_id,
               k.body, 'sent again to ask whether the far node still holds it', e.priority, k.traceparent,
               k.message_id
        FROM taken k
        JOIN broker.endpoints e ON e.conversation_handle = k.conversation_handle
        RETURNING 1
    )
    SELECT count(*)::integer FROM asked;
$$;
GRANT EXECUTE ON FUNCTION broker._probe(uuid[]) TO broker_relay;

-- Asks the far node whether it still holds the last number it acknowledged of
-- a conversation side: a running relay asks so every minute of a side it
-- sent to lately, so that a far node that went back to an earlier point is
-- found even when nothing more is sent to it.
CREATE OR REPLACE FUNCTION broker.probe_conversation(conversation uuid, sender_is_initiator boolean)
RETURNS integer
LANGUAGE sql AS $$
    SELECT broker._probe(ARRAY(SELECT e.conversation_handle FROM broker.endpoints e
                               WHERE e.conversation_id = conversation AND e.is_initiator = sender_is_initiator
                                 AND NOT e.far_is_local));
$$;
GRANT EXECUTE ON FUNCTION broker.probe_conversation(uuid, boolean) TO broker_relay;

-- A far node lost numbers it had acknowledged: its database went back to an
-- earlier point, and it may have lost as much of any conversation with this
-- node.  Each is asked (broker._probe), at most once a minute.
CREATE OR REPLACE FUNCTION broker._probe_far_node(far_instance uuid) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO broker.far_node_checks AS f (broker_instance) VALUES (far_instance)
    ON CONFLICT (broker_instance) DO UPDATE SET checked_at = excluded.checked_at
    WHERE f.checked_at < now() - interval '1 minute';
    IF FOUND THEN
        PERFORM broker._probe(ARRAY(SELECT e.conversation_handle FROM broker.endpoints e
                                    WHERE e.far_broker_instance = far_instance AND NOT e.far_is_local));
    END IF;
END $$;
GRANT EXECUTE ON FUNCTION broker._probe_far_node(uuid) TO broker_relay;

-- This side's database went back to an earlier point: the far node already
-- holds its numbers up to held, of which this side knows it had transmitted
-- only those up to transmitted (its answered_sequence).  The messages it numbered after transmitted may be
-- new ones, which the far node would discard as duplicates, or old ones it
-- holds already: this side cannot tell.  So they are numbered past held,
-- behind a broker.renumbered message (number held + 1, and a notice here) that
-- tells both applications which numbers the far side holds from before, so
-- that they can reconcile.  Nothing new is discarded.
CREATE OR REPLACE FUNCTION broker._number_past(handle uuid, held bigint, transmitted bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    e broker.endpoints;
    shift bigint := held + 1 - transmitted;
    renumbered broker.message_types := broker._message_type('broker.renumbered');
    notice bytea;
    moved broker.transmission_queue[];
BEGIN
    SELECT * INTO e FROM broker.endpoints WHERE conversation_handle = handle FOR UPDATE SKIP LOCKED;
    IF NOT FOUND OR e.state NOT IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
        RETURN;  -- held by an application (the next answer finds the same), or ended
    END IF;
    notice := convert_to(jsonb_build_object(
        'first_number', transmitted + 1, 'last_number', held, 'next_number', held + 2,
        'description', format('the database of the sending side went back to an earlier point: the receiving side '
                              'already holds numbers %s to %s from before; the sender''s messages from number %s on '
                              'follow as numbers %s on, and may repeat some of those',
                              transmitted + 1, held, transmitted + 1, held + 2))::text, 'UTF8');
    -- Taken out in one statement and put back in the next: the new numbers of
    -- some may be the old numbers of others.
    WITH taken_out AS (
        DELETE FROM broker.transmission_queue t
        WHERE t.to_service = e.far_service AND t.priority = e.priority AND t.conversation_handle = handle
          AND t.message_sequence_number > transmitted
        RETURNING t.*
    )
    SELECT array_agg(t) INTO moved FROM taken_out t;
    INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id, to_service,
                                           message_type_id, body, enqueued_at, next_attempt_at, transmission_status,
                                           priority, traceparent, message_id)
    SELECT m.conversation_handle, m.message_sequence_number + shift, m.conversation_id, m.to_service,
           m.message_type_id, m.body, m.enqueued_at, m.next_attempt_at,
           format('numbered again from %s: the far node already held that number', m.message_sequence_number),
           m.priority, m.traceparent, m.message_id
    FROM unnest(moved) m;
    INSERT INTO broker.transmission_queue (conversation_handle, message_sequence_number, conversation_id, to_service,
                                           message_type_id, body, priority)
    VALUES (handle, held + 1, e.conversation_id, e.far_service, renumbered.message_type_id, notice, e.priority);
    UPDATE broker.endpoints SET send_sequence = greatest(send_sequence, transmitted) + shift
    WHERE conversation_handle = handle;
    UPDATE broker.transmission_progress
    SET previously_transmitted = held, transmitted_sequence = held, answered_sequence = held,
        acknowledged_sequence = held
    WHERE conversation_handle = handle;
    PERFORM broker._enqueue(e, 0, renumbered.message_type_id, notice);
    PERFORM broker._record_lost_messages(e, 'sent', transmitted + 1, held, 'renumbered');
END $$;
GRANT EXECUTE ON FUNCTION broker._number_past(uuid,bigint,bigint) TO broker_relay;

-- Records numbers of a conversation side that a database going back lost
-- (see broker.lost_messages); the same numbers found again update the row.
CREATE OR REPLACE FUNCTION broker._record_lost_messages(e broker.endpoints, direction text, first_number bigint,
                                             last_number bigint, outcome text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO broker.lost_messages AS l (conversation_id, is_initiator, far_broker_instance, direction,
                                           first_number, last_number, outcome)
    VALUES (e.conversation_id, e.is_initiator, e.far_broker_instance, direction, first_number, last_number, outcome)
    ON CONFLICT (conversation_id, is_initiator, direction, first_number) DO UPDATE
    SET last_number = excluded.last_number, outcome = excluded.outcome, found_at = excluded.found_at;
$$;
GRANT EXECUTE ON FUNCTION broker._record_lost_messages(broker.endpoints,text,bigint,bigint,text) TO broker_relay;

-- A destination could not be reached: the conversations of one lane of a relay
-- (or a single one) waiting for it get the reason in words and their next
-- attempt after the relay's back-off, in one row however many messages wait.
-- Failures of addresses no longer routed to are forgotten.
CREATE OR REPLACE FUNCTION broker.record_transport_failure(destination text, first_handle uuid, last_handle uuid, reason text,
                                                retry_after interval) RETURNS void
LANGUAGE sql AS $$
    DELETE FROM broker.transmission_failures f
    WHERE NOT EXISTS (SELECT 1 FROM broker.routes r WHERE r.address = f.address);
    INSERT INTO broker.transmission_failures AS f
    VALUES (destination, first_handle, last_handle, 1, now(), now() + retry_after, reason)
    ON CONFLICT (address, first_handle, last_handle) DO UPDATE
    SET attempts = f.attempts + 1, failed_at = excluded.failed_at, next_attempt_at = excluded.next_attempt_at,
        reason = excluded.reason;
$$;
GRANT EXECUTE ON FUNCTION broker.record_transport_failure(text,uuid,uuid,text,interval) TO broker_relay;
