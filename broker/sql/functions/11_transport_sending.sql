-- Between nodes, the sending side: the relay's batches, the answers applied
-- to them (healing a far node or this one gone back to an earlier point), and
-- transmission failures.

------------------------------------------------------------------------------
-- Sending side
------------------------------------------------------------------------------

-- The next batch for a destination, as rows of broker.wire_message for
-- COPY, for the conversations whose handles fall in [first_handle,
-- last_handle]: a relay splits the conversations among lanes that send at
-- once.  Two kinds of messages are read.  The log past the lane's cursor
-- (broker.transmission_cursors), service by service and priority by priority
-- in the order of position, up to max_messages each, passing over what the
-- far node acknowledged, and the conversations that wait in
-- broker.transmission_retries: a long backlog costs a batch no more than a
-- short one, no message is deleted or changed once sent, and messages waiting
-- for other destinations are not read at all.  A conversation whose message
-- is held (until its delivery time, or behind a failure of its own) is
-- passed over from that message on, and waits in transmission_retries until
-- then.  And the conversations of transmission_retries that are due, by
-- their numbers.  Of both, the first max_messages, the highest priority
-- first, are taken, and the batch is cut where its bodies and headers reach
-- max_bytes.  The first message always goes, whatever its size, so that a
-- message at the size limit still travels alone.  A message's share is its
-- body and the texts that travel with it (its traceparent among them), plus
-- 100 bytes for the fixed-size fields and lengths of its row in the binary
-- COPY format.  The numbers taken are recorded in
-- broker.transmission_progress, in the relay's transaction that commits
-- before the batch leaves; where the cursor may move once the far node has
-- answered is kept in the session's setting broker.batch_cursor, for
-- broker.apply_transport_results.  While a failure of the whole lane waits
-- for its retry, nothing is read.
--
-- Its statements are planned once a session, whatever the values
-- (plan_cache_mode): planned anew for each batch, the reading cost more to
-- plan than to run a batch of a few messages.  So no condition leaves the
-- plan to the values: the lane's handles are tested row by row (IS TRUE),
-- never taken as a range of the log's primary key, which would read every
-- message of the lane that the log retains; and what the far node
-- acknowledged of a conversation is looked up by its key for each message or
-- conversation read (a scalar subquery), which a join would leave to the
-- plan: one kept for the session was seen to scan every conversation's
-- progress for each message, doubling the reading's cost.  Nor is a batch
-- compiled (jit): compiling costs tens of milliseconds, more than the batch,
-- and a misestimated cost can call for it.
CREATE OR REPLACE FUNCTION broker.next_batch(destination text, max_messages integer, max_bytes bigint,
                                             first_handle uuid, last_handle uuid)
RETURNS SETOF broker.wire_message
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET jit = off AS $$
DECLARE
    lane broker.transmission_cursors;
    log_end bigint;
    seen pg_snapshot;
    held_back boolean;  -- conversations held back after a failure: seldom any, so each message is looked at only then
    retrying boolean;
    bounded boolean;  -- whether this transaction takes its id after log_end is read (see below)
    settled boolean;  -- whether every transaction that may have taken a position up to lane.seen_position ended
BEGIN  -- plpgsql rather than sql: the plans are kept between batches
    -- Where the log ends, then the transactions open.  A writer takes its id
    -- before its position, so every transaction that took a position up to
    -- log_end has an id below the one this transaction takes next, when it
    -- has none yet: the cursor may move up to log_end once every transaction
    -- of an id up to this one's has ended (the xmin of a later snapshot is
    -- past it).  A snapshot's xmax alone does not bound them: it is one past
    -- the latest transaction that ended, and an open transaction younger than
    -- that is neither in the snapshot nor below its xmin.  Each statement sees
    -- the database anew, so a transaction that took a position up to log_end
    -- is seen by the reading once it has committed.
    bounded := pg_current_xact_id_if_assigned() IS NULL;
    log_end := (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM broker.transmission_log_position);
    seen := pg_current_snapshot();
    PERFORM broker._drain_transmission_queue();
    IF EXISTS (SELECT 1 FROM broker.transmission_failures f
               WHERE f.address = destination AND f.next_attempt_at > now()
                 AND f.first_handle <= next_batch.first_handle AND f.last_handle >= next_batch.last_handle) THEN
        RETURN;
    END IF;
    retrying := EXISTS (SELECT 1 FROM broker.transmission_retries r
                        JOIN broker.routes rt ON rt.service_name = r.to_service AND rt.address = destination);
    -- A lane whose cursor stands at the log's end, with no batch unanswered and
    -- no conversation of the destination waiting to be read by number, has
    -- nothing to read or move: an idle lane's poll writes nothing (no
    -- transaction id, no WAL).  Read without a lock, as nothing is changed.
    SELECT * INTO lane FROM broker.transmission_cursors c
    WHERE c.address = destination AND c.first_handle = next_batch.first_handle
      AND c.last_handle = next_batch.last_handle;
    IF NOT retrying AND lane.read_position = log_end AND lane.seen_position = log_end
       AND lane.pending_read_position IS NULL THEN
        RETURN;
    END IF;
    INSERT INTO broker.transmission_cursors AS c (address, first_handle, last_handle)
    VALUES (destination, next_batch.first_handle, next_batch.last_handle)
    ON CONFLICT ON CONSTRAINT transmission_cursors_pkey DO UPDATE SET address = c.address
    RETURNING * INTO lane;
    settled := pg_snapshot_xmin(seen) > lane.seen_xmax;
    PERFORM set_config('broker.batch_cursor', json_build_object(
        'address', destination, 'first_handle', next_batch.first_handle, 'last_handle', next_batch.last_handle)::text,
        false);
    held_back := EXISTS (SELECT 1 FROM broker.transmission_failures f
                         WHERE f.address = destination AND f.next_attempt_at > now());
    -- The rows are carried by their place in the table (ctid) and the length
    -- of their bodies, and the bodies read once, for the rows that go.
    RETURN QUERY
    WITH fetched AS (  -- the log past the cursor
        SELECT t.row_id, t.position, t.conversation_handle, t.message_sequence_number, t.to_service,
               t.priority, t.next_attempt_at, t.message_id, t.message_type_id, octet_length(t.body) AS body_bytes,
               t.traceparent
        FROM broker.routes r, generate_series(10, 1, -1) AS p(priority),
             LATERAL (SELECT t.ctid AS row_id, t.* FROM broker.transmission_log t
                      WHERE t.to_service = r.service_name AND t.priority = p.priority
                        AND t.position > lane.read_position
                        AND (t.conversation_handle BETWEEN next_batch.first_handle AND next_batch.last_handle) IS TRUE
                        AND t.message_sequence_number > coalesce(
                            (SELECT a.acknowledged_sequence FROM broker.transmission_progress a
                             WHERE a.conversation_handle = t.conversation_handle), 0)
                        AND NOT (retrying AND EXISTS (SELECT 1 FROM broker.transmission_retries w
                                                      WHERE w.conversation_handle = t.conversation_handle))
                      ORDER BY t.position
                      LIMIT max_messages) t
        WHERE r.address = destination
    ), flagged AS (
        SELECT f.*, CASE WHEN f.next_attempt_at > now() THEN f.next_attempt_at
                         WHEN held_back THEN (SELECT max(x.next_attempt_at) FROM broker.transmission_failures x
                                              WHERE x.address = destination AND x.next_attempt_at > now()
                                                AND f.conversation_handle BETWEEN x.first_handle AND x.last_handle)
                         END AS held_until
        FROM fetched f
    ), holds AS (  -- a conversation whose message is held waits from that message on
        SELECT x.conversation_handle, x.to_service, x.priority, min(x.message_sequence_number) AS from_number,
               min(x.held_until) AS held_until
        FROM flagged x WHERE x.held_until IS NOT NULL
        GROUP BY x.conversation_handle, x.to_service, x.priority
    ), held AS (
        INSERT INTO broker.transmission_retries (conversation_handle, to_service, priority, next_attempt_at)
        SELECT h.conversation_handle, h.to_service, h.priority, h.held_until FROM holds h
        ON CONFLICT (conversation_handle) DO NOTHING
    ), due AS (  -- the conversations of transmission_retries whose time has come
        SELECT r.*, coalesce(r.first_number,
                             coalesce((SELECT a.acknowledged_sequence FROM broker.transmission_progress a
                                       WHERE a.conversation_handle = r.conversation_handle), 0) + 1) AS from_number
        FROM broker.transmission_retries r
        JOIN broker.routes rt ON rt.service_name = r.to_service AND rt.address = destination
        WHERE retrying AND r.next_attempt_at <= now()
          AND r.conversation_handle BETWEEN next_batch.first_handle AND next_batch.last_handle
          AND NOT (held_back AND EXISTS (SELECT 1 FROM broker.transmission_failures x
                                         WHERE x.address = destination AND x.next_attempt_at > now()
                                           AND r.conversation_handle BETWEEN x.first_handle AND x.last_handle))
        ORDER BY r.priority DESC, r.next_attempt_at
        LIMIT max_messages
    ), numbered AS (  -- their messages by number, up to the first held one
        SELECT t.*, bool_or(t.next_attempt_at > now())
                        OVER (PARTITION BY t.conversation_handle ORDER BY t.message_sequence_number) AS held
        FROM due d,
             LATERAL (SELECT t.ctid AS row_id, t.conversation_handle, t.message_sequence_number, t.priority,
                             t.next_attempt_at, t.message_id, t.message_type_id, octet_length(t.body) AS body_bytes,
                             t.traceparent
                      FROM broker.transmission_log t
                      WHERE t.conversation_handle = d.conversation_handle
                        AND t.message_sequence_number >= d.from_number
                      ORDER BY t.message_sequence_number
                      LIMIT max_messages) t
    ), postponed AS (  -- a conversation whose next message is held waits until its time
        UPDATE broker.transmission_retries r SET next_attempt_at = n.next_attempt_at
        FROM (SELECT DISTINCT ON (n.conversation_handle) n.conversation_handle, n.next_attempt_at
              FROM numbered n ORDER BY n.conversation_handle, n.message_sequence_number) n
        WHERE r.conversation_handle = n.conversation_handle AND n.next_attempt_at > now()
    ), candidates AS (
        SELECT x.row_id, x.conversation_handle, x.message_sequence_number, x.priority, x.position AS log_position,
               x.message_id, x.message_type_id, x.body_bytes, x.traceparent
        FROM flagged x
        WHERE NOT EXISTS (SELECT 1 FROM holds h WHERE h.conversation_handle = x.conversation_handle
                                                 AND x.message_sequence_number >= h.from_number)
        UNION ALL
        SELECT n.row_id, n.conversation_handle, n.message_sequence_number, n.priority, NULL, n.message_id,
               n.message_type_id, n.body_bytes, n.traceparent
        FROM numbered n WHERE NOT n.held
    ), batch AS (
        SELECT sized.*
        FROM (SELECT b.row_id, b.conversation_handle, e.conversation_id, e.is_initiator, s.name AS from_service,
                     e.far_service AS to_service, c.name AS contract, e.expires_at,
                     b.message_sequence_number AS sequence_number, b.message_id, mt.name AS message_type,
                     b.traceparent, b.log_position,
                     sum(100 + coalesce(b.body_bytes, 0) + octet_length(s.name)
                         + octet_length(e.far_service) + octet_length(c.name) + octet_length(mt.name)
                         + coalesce(octet_length(b.traceparent), 0))
                         OVER (ORDER BY b.priority DESC, b.conversation_handle, b.message_sequence_number)
                         AS bytes_so_far,
                     row_number() OVER (ORDER BY b.priority DESC, b.conversation_handle,
                                                 b.message_sequence_number) AS place
              FROM candidates b
              JOIN broker.endpoints e ON e.conversation_handle = b.conversation_handle AND NOT e.far_is_local
              JOIN broker.services s ON s.service_id = e.service_id
              JOIN broker.contracts c ON c.contract_id = e.contract_id
              JOIN broker.message_types mt ON mt.message_type_id = b.message_type_id) sized
        WHERE sized.place = 1 OR (sized.place <= max_messages AND sized.bytes_so_far <= max_bytes)
    ), unread AS (  -- the log's messages read and not taken, and what a priority that filled did not read
        SELECT least((SELECT min(c.log_position) - 1 FROM candidates c
                      WHERE c.log_position IS NOT NULL
                        AND NOT EXISTS (SELECT 1 FROM batch b WHERE b.conversation_handle = c.conversation_handle
                                                                AND b.sequence_number = c.message_sequence_number)),
                     (SELECT min(g.last_fetched)
                      FROM (SELECT max(f.position) AS last_fetched, count(*) AS fetched
                            FROM fetched f GROUP BY f.to_service, f.priority) g
                      WHERE g.fetched >= max_messages)) AS below
    ), recorded AS (
        INSERT INTO broker.transmission_progress AS p (conversation_handle, transmitted_sequence)
        SELECT b.conversation_handle, max(b.sequence_number) FROM batch b GROUP BY b.conversation_handle
        ON CONFLICT (conversation_handle) DO UPDATE
        SET previously_transmitted = p.transmitted_sequence,
            transmitted_sequence = greatest(p.transmitted_sequence, excluded.transmitted_sequence)
    ), moved AS (  -- where the cursor goes once the far node has answered (broker.apply_transport_results)
        UPDATE broker.transmission_cursors c
        SET pending_read_position = CASE WHEN settled
                                         THEN greatest(lane.read_position,
                                                       least(lane.seen_position, (SELECT below FROM unread)))
                                         ELSE lane.read_position END,
            pending_seen_position = CASE WHEN settled AND bounded THEN log_end ELSE lane.seen_position END,
            pending_seen_xmax = CASE WHEN settled AND bounded THEN pg_current_xact_id() ELSE lane.seen_xmax END
        WHERE c.address = lane.address AND c.first_handle = lane.first_handle AND c.last_handle = lane.last_handle
    )
    SELECT b.conversation_id, b.is_initiator, b.from_service, b.to_service, b.contract, b.expires_at,
           b.sequence_number, b.message_id, b.message_type, t.body, b.traceparent
    FROM batch b
    JOIN broker.transmission_log t ON t.ctid = b.row_id
    ORDER BY b.place;
    IF NOT FOUND THEN  -- nothing waits for an answer: the cursor moves now
        PERFORM broker._move_cursor(lane.address, lane.first_handle, lane.last_handle);
    END IF;
END $$;
COMMENT ON FUNCTION broker.next_batch(text, integer, bigint, uuid, uuid) IS $$(relay) The next batch for a destination
(a node's address), as rows of `wire_message`: the waiting messages of its conversations whose handles lie between
`first_handle` and `last_handle` (a relay's lane), read from the transmission log by position and, for the
conversations held back before, by number, the highest priority first, up to `max_messages` and `max_bytes` (the
first message always goes), passing over conversations that wait for a retry after a failure. The numbers taken are
recorded in `transmission_progress`.$$;
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
COMMENT ON FUNCTION broker.transport_batch(text, integer, bigint, uuid, uuid) IS $$(relay) `next_batch` without
message ids (rows of `transport_message`, wire version 3), for a relay of the release before revision 0035.$$;
GRANT EXECUTE ON FUNCTION broker.transport_batch(text,integer,bigint,uuid,uuid) TO broker_relay;

-- Takes a lane's cursor where the batch read last left it pending
-- (broker.next_batch): the far node has answered that batch.
CREATE OR REPLACE FUNCTION broker._move_cursor(destination text, lane_first uuid, lane_last uuid) RETURNS void
LANGUAGE sql AS $$
    UPDATE broker.transmission_cursors c
    SET read_position = c.pending_read_position, seen_position = c.pending_seen_position,
        seen_xmax = c.pending_seen_xmax, pending_read_position = NULL, pending_seen_position = NULL,
        pending_seen_xmax = NULL
    WHERE c.address = destination AND c.first_handle = lane_first AND c.last_handle = lane_last
      AND c.pending_read_position IS NOT NULL;
$$;
GRANT EXECUTE ON FUNCTION broker._move_cursor(text,uuid,uuid) TO broker_relay;

-- A lane's cursor passes only over messages acknowledged, waiting in
-- broker.transmission_retries, or gone (broker.transmission_cursors).  A
-- conversation side with a message at or below its lane's read position that
-- none of these holds would wait for ever: it is put in transmission_retries
-- and read by number from its first unacknowledged message, which at worst
-- sends again what the far node acknowledges as duplicates.  Returns the
-- handles of the sides so found: none, unless the reading has a fault, which
-- the relay then reports.  A running relay calls it every minute.
CREATE OR REPLACE FUNCTION broker.retry_passed_over() RETURNS SETOF uuid
LANGUAGE sql AS $$
    INSERT INTO broker.transmission_retries (conversation_handle, to_service, priority, reason)
    SELECT e.conversation_handle, e.far_service, e.priority, 'passed over by the reading: sent again by number'
    FROM broker.endpoints e
    LEFT JOIN broker.transmission_progress p ON p.conversation_handle = e.conversation_handle
    JOIN broker.transmission_log t ON t.conversation_handle = e.conversation_handle
                                  AND t.message_sequence_number = coalesce(p.acknowledged_sequence, 0) + 1
    WHERE NOT e.far_is_local AND e.send_sequence > coalesce(p.acknowledged_sequence, 0)
      AND NOT EXISTS (SELECT 1 FROM broker.transmission_retries r WHERE r.conversation_handle = e.conversation_handle)
      AND EXISTS (SELECT 1 FROM broker.routes rt
                  JOIN broker.transmission_cursors c ON c.address = rt.address
                  WHERE rt.service_name = e.far_service
                    AND e.conversation_handle BETWEEN c.first_handle AND c.last_handle
                    AND t.position <= c.read_position)
    ON CONFLICT (conversation_handle) DO NOTHING
    RETURNING conversation_handle;
$$;
COMMENT ON FUNCTION broker.retry_passed_over() IS $$(relay) Puts in `transmission_retries` each conversation side
whose first unacknowledged message lies at or below its relay lane's read position without waiting there, so that
it is sent by number; returns their handles (none, unless the reading has a fault). A running relay calls it every
minute.$$;
GRANT EXECUTE ON FUNCTION broker.retry_passed_over() TO broker_relay;

-- What a node of the release before revision 0037 left in
-- broker.transmission_queue while it served a database migrated ahead of it
-- goes to the transmission log, and its conversations are read by number
-- (broker.transmission_retries), so that each goes on in order.  Nothing is
-- left there once no node of that release serves.
CREATE OR REPLACE FUNCTION broker._drain_transmission_queue() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM broker.transmission_queue) THEN
        WITH moved AS (
            DELETE FROM broker.transmission_queue t RETURNING t.*
        ), appended AS (
            INSERT INTO broker.transmission_log (conversation_handle, message_sequence_number, conversation_id,
                                                 to_service, priority, message_type_id, body, enqueued_at,
                                                 next_attempt_at, traceparent, message_id)
            SELECT m.conversation_handle, m.message_sequence_number, m.conversation_id, m.to_service, m.priority,
                   m.message_type_id, m.body, m.enqueued_at,
                   CASE WHEN m.attempts = 0 THEN m.next_attempt_at ELSE m.enqueued_at END, m.traceparent,
                   coalesce(m.message_id, gen_random_uuid())
            FROM moved m
            ORDER BY m.conversation_handle, m.message_sequence_number
            ON CONFLICT ON CONSTRAINT transmission_log_pkey DO NOTHING
        )
        INSERT INTO broker.transmission_retries AS r (conversation_handle, to_service, priority)
        SELECT DISTINCT m.conversation_handle, m.to_service, m.priority
        FROM moved m
        JOIN broker.endpoints e ON e.conversation_handle = m.conversation_handle AND NOT e.far_is_local
        ON CONFLICT (conversation_handle) DO UPDATE SET next_attempt_at = now(), first_number = NULL;
    END IF;
END $$;
GRANT EXECUTE ON FUNCTION broker._drain_transmission_queue() TO broker_relay;

-- Applies a destination node's answer in one transaction: each conversation
-- side's acknowledged number moves on (nothing is deleted or copied: the log
-- keeps what was acknowledged for broker.node.resend_window), what it refused
-- ends, and what it held back or did not take waits in
-- broker.transmission_retries; then the lane's cursor moves past the batch
-- (broker.next_batch).  Returns how many numbers were newly acknowledged.
-- The work is per conversation, not per message, and refusals are rare and
-- handled one by one.  The transaction that applies an answer commits without
-- waiting for its WAL to reach the disk: if a crash loses it, the messages it
-- acknowledged are sent again and the far node acknowledges them as
-- duplicates (guarantee 3), so the relay need not wait for a flush in every
-- cycle.  Planned once a session and never compiled, as broker.next_batch is:
-- its statements read the answer's conversations by key, whatever their
-- number.
--
-- The answer is held to the batch it answers: the relay passes the highest
-- number the batch carried of each conversation side it carried
-- (sent_conversations, sent_by_initiator and last_sent, in step), and only the
-- results for those apply, each acknowledging at most that number.  So no
-- answer, however it is signed, acknowledges, refuses or holds back a message
-- it was not sent.  A result without a number acknowledges nothing, and a
-- side the answer says nothing of is sent again.
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
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET jit = off AS $$
DECLARE
    handles uuid[];
    services text[];
    priorities smallint[];
    acknowledged bigint[];
    acknowledged_before bigint[];
    refusals text[];
    holds text[];
    carried bigint[];
    went_back_here_or_there uuid[];
    not_taken boolean;  -- whether the far node held back or did not take some of what it was sent
    any_refused boolean;
    result record;
    went_back uuid[] := '{}';
    sent_again uuid[] := '{}';
    far_node_lost boolean := false;
    delivered bigint;
    lane jsonb := nullif(current_setting('broker.batch_cursor', true), '')::jsonb;
    told_retention interval := make_interval(secs => (answer ->> 'tombstone_retention_s')::float8);
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    -- Each side of the batch with its result, and those whose result shows a
    -- database that went back (see broker.transmission_progress).  A side
    -- that ended here may have been acknowledged by a far node that had
    -- forgotten the conversation (held only what it received before), so
    -- held is compared only while this side converses.
    WITH sent AS (
        SELECT * FROM unnest(sent_conversations, sent_by_initiator, last_sent)
                      AS s(conversation_id, sender_is_initiator, last_sent)
    ), answered_sides AS (
        SELECT e.conversation_handle, e.far_service, e.priority, e.send_sequence, e.state, s.last_sent,
               r.acknowledged AS reported, r.refused, r.waiting,
               coalesce(r.held, CASE WHEN r.waiting IS NOT NULL THEN r.acknowledged END) AS held, r.held_message_id,
               p.previously_transmitted, p.acknowledged_sequence
        FROM jsonb_to_recordset(answer -> 'results')
             AS r(conversation_id uuid, sender_is_initiator boolean, acknowledged bigint, held bigint,
                  held_message_id uuid, refused jsonb, waiting text)
        JOIN sent s ON s.conversation_id = r.conversation_id AND s.sender_is_initiator = r.sender_is_initiator
        JOIN broker.endpoints e ON e.conversation_id = s.conversation_id AND e.is_initiator = s.sender_is_initiator
                               AND NOT e.far_is_local
        LEFT JOIN broker.transmission_progress p ON p.conversation_handle = e.conversation_handle
    )
    SELECT array_agg(a.conversation_handle), array_agg(a.far_service), array_agg(a.priority),
           array_agg(least(coalesce(a.reported, 0), a.last_sent)), array_agg(coalesce(a.acknowledged_sequence, 0)),
           array_agg(CASE WHEN a.refused IS NOT NULL
                          THEN coalesce(a.refused ->> 'reason', 'no reason given') END),
           array_agg(a.waiting), array_agg(a.last_sent),
           coalesce(bool_or(a.waiting IS NOT NULL OR coalesce(a.reported, 0) < a.last_sent), false),
           coalesce(bool_or(a.refused IS NOT NULL), false),
           array_agg(a.conversation_handle) FILTER (WHERE
               a.reported < a.acknowledged_sequence OR a.held > a.previously_transmitted
               OR a.reported > a.send_sequence
               OR (a.held < a.acknowledged_sequence AND a.state IN ('conversing', 'disconnected_outbound'))
               OR (a.held > a.acknowledged_sequence AND a.held_message_id IS NOT NULL
                   AND EXISTS (SELECT 1 FROM broker.transmission_log t
                               WHERE t.conversation_handle = a.conversation_handle
                                 AND t.message_sequence_number = a.held
                                 AND t.message_id IS DISTINCT FROM a.held_message_id)))
    INTO handles, services, priorities, acknowledged, acknowledged_before, refusals, holds, carried, not_taken,
         any_refused, went_back_here_or_there
    FROM answered_sides a;
    -- A side the answer says nothing of is sent again, by number.
    IF coalesce(cardinality(handles), 0) < cardinality(sent_conversations) THEN
        INSERT INTO broker.transmission_retries (conversation_handle, to_service, priority)
        SELECT e.conversation_handle, e.far_service, e.priority
        FROM unnest(sent_conversations, sent_by_initiator) AS s(conversation_id, sender_is_initiator)
        JOIN broker.endpoints e ON e.conversation_id = s.conversation_id AND e.is_initiator = s.sender_is_initiator
                               AND NOT e.far_is_local
        WHERE e.conversation_handle <> ALL (coalesce(handles, '{}'))
        ON CONFLICT (conversation_handle) DO UPDATE SET next_attempt_at = now(), first_number = NULL;
    END IF;

    -- The far node's retention, when it tells one this node does not hold yet:
    -- an upsert of the row it holds would lock that row at every answer.
    INSERT INTO broker.peer_retention AS p (broker_instance, tombstone_retention)
    SELECT e.far_broker_instance, told_retention
    FROM broker.endpoints e
    WHERE e.conversation_handle = handles[1] AND told_retention IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM broker.peer_retention held
                      WHERE held.broker_instance = e.far_broker_instance AND held.tombstone_retention = told_retention)
    ON CONFLICT (broker_instance) DO UPDATE
    SET tombstone_retention = excluded.tombstone_retention, learned_at = excluded.learned_at
    WHERE p.tombstone_retention <> excluded.tombstone_retention;

    -- Seldom any: the statement is not run for nothing, as its plan, kept for
    -- the session, may read every endpoint whatever the handles.
    IF went_back_here_or_there IS NOT NULL THEN
        FOR result IN
            SELECT e.conversation_handle, a.acknowledged AS reported,
                   coalesce(a.held, CASE WHEN a.waiting IS NOT NULL THEN a.acknowledged END) AS held,
                   p.previously_transmitted, p.answered_sequence, p.acknowledged_sequence, e.send_sequence
            FROM broker.endpoints e
            JOIN broker.transmission_progress p ON p.conversation_handle = e.conversation_handle
            JOIN jsonb_to_recordset(answer -> 'results') AS a(conversation_id uuid, sender_is_initiator boolean,
                                                                acknowledged bigint, held bigint, waiting text)
              ON a.conversation_id = e.conversation_id AND a.sender_is_initiator = e.is_initiator
            WHERE e.conversation_handle = ANY (went_back_here_or_there)
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
                PERFORM broker._number_past(
                    result.conversation_handle, greatest(result.reported, result.held),
                    least(result.answered_sequence, greatest(result.reported, result.held) - 1));
            END IF;
        END LOOP;
    END IF;
    IF far_node_lost THEN
        PERFORM broker._probe_far_node(e.far_broker_instance)
        FROM broker.endpoints e WHERE e.conversation_handle = handles[1];
    END IF;

    -- Each side's watermark moves on, unless its answer showed a database that
    -- went back: what that answer acknowledges is not what this side sent.
    UPDATE broker.transmission_progress p
    SET acknowledged_sequence = greatest(p.acknowledged_sequence, a.acknowledged),
        answered_sequence = p.transmitted_sequence
    FROM unnest(handles, acknowledged) AS a(conversation_handle, acknowledged)
    WHERE p.conversation_handle = a.conversation_handle AND a.conversation_handle <> ALL (went_back);
    delivered := (SELECT coalesce(sum(greatest(a.acknowledged - a.before, 0)), 0)
                  FROM unnest(handles, acknowledged, acknowledged_before) AS a(conversation_handle, acknowledged, before)
                  WHERE a.conversation_handle <> ALL (went_back));
    -- The far node answered for these: earlier failures no longer apply.
    IF EXISTS (SELECT 1 FROM broker.transmission_failures) THEN
        DELETE FROM broker.transmission_failures f
        WHERE f.next_attempt_at <= now()
          AND f.address IN (SELECT r.address FROM broker.routes r WHERE r.service_name = ANY (services))
          AND EXISTS (SELECT 1 FROM unnest(handles) h WHERE h BETWEEN f.first_handle AND f.last_handle);
    END IF;

    -- What the far node did not take of the batch is read by number from now
    -- on: the cursor moves past it.  A side held back is tried again after a
    -- back-off that doubles with each attempt, from a quarter of a second up
    -- to a minute.  A side that took all it was sent goes on by number while
    -- it waits in transmission_retries, and leaves them once the log holds
    -- nothing more of it.
    -- In the steady state none of these has anything to do: each runs only when it may.
    IF not_taken OR went_back <> '{}' THEN
        INSERT INTO broker.transmission_retries AS r (conversation_handle, to_service, priority, next_attempt_at,
                                                      attempts, reason)
        SELECT a.conversation_handle, a.to_service, a.priority,
               now() + CASE WHEN a.waiting IS NOT NULL THEN interval '250 milliseconds' ELSE interval '0' END,
               CASE WHEN a.waiting IS NOT NULL THEN 1 ELSE 0 END, 'the far node holds it back: ' || a.waiting
        FROM unnest(handles, services, priorities, acknowledged, carried, refusals, holds)
             AS a(conversation_handle, to_service, priority, acknowledged, carried, refused, waiting)
        WHERE a.refused IS NULL AND a.conversation_handle <> ALL (sent_again)
          AND (a.waiting IS NOT NULL OR a.acknowledged < a.carried OR a.conversation_handle = ANY (went_back))
        ON CONFLICT (conversation_handle) DO UPDATE
        SET next_attempt_at = CASE WHEN excluded.reason IS NULL THEN now()
                                   ELSE now() + least(interval '60 seconds',
                                                      interval '250 milliseconds' * 2 ^ r.attempts) END,
            attempts = CASE WHEN excluded.reason IS NULL THEN 0 ELSE r.attempts + 1 END,
            reason = excluded.reason, first_number = NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM broker.transmission_retries) THEN
        WITH settled AS (
            SELECT a.conversation_handle,
                   EXISTS (SELECT 1 FROM broker.transmission_log t
                           WHERE t.conversation_handle = a.conversation_handle
                             AND t.message_sequence_number > a.acknowledged) AS more
            FROM unnest(handles, acknowledged, carried, refusals, holds)
                 AS a(conversation_handle, acknowledged, carried, refused, waiting)
            JOIN broker.transmission_retries r ON r.conversation_handle = a.conversation_handle
            WHERE a.refused IS NULL AND a.waiting IS NULL AND a.acknowledged >= a.carried
              AND a.conversation_handle <> ALL (went_back)
        ), going_on AS (
            UPDATE broker.transmission_retries r
            SET next_attempt_at = now(), attempts = 0, reason = NULL, first_number = NULL
            FROM settled s WHERE r.conversation_handle = s.conversation_handle AND s.more
        )
        DELETE FROM broker.transmission_retries r
        USING settled s WHERE r.conversation_handle = s.conversation_handle AND NOT s.more;
    END IF;

    IF any_refused THEN
        FOR result IN
            SELECT * FROM unnest(handles, refusals) AS a(conversation_handle, refused)
            WHERE a.refused IS NOT NULL AND a.conversation_handle <> ALL (sent_again)
        LOOP
            PERFORM broker._refused_by_far_side(broker._lock_endpoint(result.conversation_handle), result.refused);
        END LOOP;
    END IF;
    IF delivered > 0 THEN  -- an endpoint closed while its last messages waited can be forgotten now
        PERFORM broker.forget_closed_endpoints(4);
    END IF;
    IF lane IS NOT NULL THEN
        PERFORM broker._move_cursor(lane ->> 'address', (lane ->> 'first_handle')::uuid, (lane ->> 'last_handle')::uuid);
        PERFORM set_config('broker.batch_cursor', '', false);
    END IF;
    RETURN delivered;
END $$;
COMMENT ON FUNCTION broker.apply_transport_results(jsonb, uuid[], boolean[], bigint[]) IS $$(relay) Applies a
destination node's answer to the batch it was sent (`sent_conversations`, `sent_by_initiator` and `last_sent`: the
highest number the batch carried of each conversation side), in one transaction: moves on what it acknowledged (kept
in the transmission log for `broker.node.resend_window`), ends what it refused, and tries again later what it held
back (after a quarter of a second, doubling up to a minute). An answer that shows a database gone back to an earlier
point, here or there, sends again, renumbers or probes, and records it in `lost_messages`. Returns how many messages
were delivered.$$;
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
COMMENT ON FUNCTION broker.apply_transport_results(jsonb) IS $$(relay) `apply_transport_results` of the batch in
`pg_temp.sent_transport_batch`, as the relay of a release before revision 0031 copies it there.$$;
GRANT EXECUTE ON FUNCTION broker.apply_transport_results(jsonb) TO broker_relay;

-- Puts back in the transmission log what the release before revision 0037
-- kept of a conversation side's numbers first_number to last_number in its
-- resend window (broker.acknowledged_messages), which it kept apart.
CREATE OR REPLACE FUNCTION broker._restore_kept(handle uuid, first_number bigint, last_number bigint) RETURNS void
LANGUAGE sql AS $$
    WITH taken_back AS (
        DELETE FROM broker.acknowledged_messages k
        WHERE k.conversation_handle = handle AND k.message_sequence_number BETWEEN first_number AND last_number
        RETURNING k.*
    )
    INSERT INTO broker.transmission_log (conversation_handle, message_sequence_number, conversation_id, to_service,
                                         priority, message_type_id, body, enqueued_at, traceparent, message_id)
    SELECT k.conversation_handle, k.message_sequence_number, e.conversation_id, e.far_service, e.priority,
           k.message_type_id, k.body, k.enqueued_at, k.traceparent, coalesce(k.message_id, gen_random_uuid())
    FROM taken_back k
    JOIN broker.endpoints e ON e.conversation_handle = k.conversation_handle
    ORDER BY k.message_sequence_number
    ON CONFLICT ON CONSTRAINT transmission_log_pkey DO NOTHING;
$$;
GRANT EXECUTE ON FUNCTION broker._restore_kept(uuid,bigint,bigint) TO broker_relay;

-- The far node lost the numbers after held up to acknowledged of a
-- conversation side's messages, which it had acknowledged: its database went
-- back to an earlier point.  They are sent again from the transmission log,
-- in order and before the messages that wait (the side is read by number,
-- from held + 1: broker.transmission_retries).  When the log no longer holds
-- them all within broker.node.resend_window of when they were sent (it may
-- hold older ones until the relay forgets them), the conversation ends with
-- broker.error code -4 on both sides (the far node takes the error across the
-- numbers it lacks).  Either way the loss is recorded in broker.lost_messages.
-- Returns whether they were sent again.
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
    PERFORM broker._restore_kept(handle, held + 1, acknowledged);
    resent := (SELECT count(*) FROM broker.transmission_log t
               WHERE t.conversation_handle = handle AND t.message_sequence_number BETWEEN held + 1 AND acknowledged
                 AND t.enqueued_at >= now() - (SELECT n.resend_window FROM broker.node n))
              = acknowledged - held;
    IF resent THEN
        INSERT INTO broker.transmission_retries AS r (conversation_handle, to_service, priority, reason)
        VALUES (handle, e.far_service, e.priority,
                format('sent again: the far node lost it (its database went back to number %s)', held))
        ON CONFLICT (conversation_handle) DO UPDATE
        SET next_attempt_at = now(), attempts = 0, first_number = NULL, reason = excluded.reason;
    ELSE  -- what the log still holds of them is older than the window: none goes
        DELETE FROM broker.transmission_log t
        WHERE t.conversation_handle = handle AND t.message_sequence_number BETWEEN held + 1 AND acknowledged;
        IF e.state IN ('conversing', 'disconnected_inbound', 'disconnected_outbound') THEN
            PERFORM broker._fail_conversation(e, -4, format(
                'messages %s to %s of this conversation were lost: the far node''s database went back to an '
                'earlier point, and this node no longer keeps them (broker.node.resend_window)', held + 1,
                acknowledged));
        END IF;
    END IF;
    UPDATE broker.transmission_progress SET acknowledged_sequence = held WHERE conversation_handle = handle;
    PERFORM broker._record_lost_messages(e, 'sent', held + 1, acknowledged,
                                         CASE WHEN resent THEN 'resent' ELSE 'lost' END);
    RETURN resent;
END $$;
GRANT EXECUTE ON FUNCTION broker._send_again(uuid,bigint,bigint) TO broker_relay;

-- Asks the far node whether it still holds what it acknowledged of these
-- conversation sides: the highest number it acknowledged of each goes again,
-- from the transmission log while it is within the resend window
-- (broker.transmission_retries, from that number),
-- unless something of the conversation waits to be sent (the next batch asks
-- then) or it waits for a retry already.  A far node that holds it
-- acknowledges it as a duplicate; one that went back to an earlier point
-- takes it again, or asks for the numbers it lacks
-- (broker.apply_transport_results).  Only sides that converse are asked.
-- Returns how many were asked.
CREATE OR REPLACE FUNCTION broker._probe(handles uuid[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    sides uuid[];
    asked integer;
BEGIN
    SELECT array_agg(e.conversation_handle) INTO sides
    FROM broker.transmission_progress p
    JOIN broker.endpoints e ON e.conversation_handle = p.conversation_handle
    WHERE p.conversation_handle = ANY (handles) AND p.acknowledged_sequence > 0
      AND e.state IN ('conversing', 'disconnected_outbound') AND NOT e.far_is_local
      AND e.send_sequence <= p.acknowledged_sequence
      AND NOT EXISTS (SELECT 1 FROM broker.transmission_retries r WHERE r.conversation_handle = e.conversation_handle);
    PERFORM broker._restore_kept(p.conversation_handle, p.acknowledged_sequence, p.acknowledged_sequence)
    FROM broker.transmission_progress p WHERE p.conversation_handle = ANY (sides);
    INSERT INTO broker.transmission_retries (conversation_handle, to_service, priority, first_number, reason)
    SELECT e.conversation_handle, e.far_service, e.priority, p.acknowledged_sequence,
           'sent again to ask whether the far node still holds it'
    FROM broker.endpoints e
    JOIN broker.transmission_progress p ON p.conversation_handle = e.conversation_handle
    WHERE e.conversation_handle = ANY (sides)
      AND EXISTS (SELECT 1 FROM broker.transmission_log t
                  WHERE t.conversation_handle = e.conversation_handle
                    AND t.message_sequence_number = p.acknowledged_sequence
                    AND t.enqueued_at >= now() - (SELECT n.resend_window FROM broker.node n))
    ON CONFLICT (conversation_handle) DO NOTHING;
    GET DIAGNOSTICS asked = ROW_COUNT;
    RETURN asked;
END $$;
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
COMMENT ON FUNCTION broker.probe_conversation(uuid, boolean) IS $$(admin, relay) Sends the last number the far node
acknowledged of a conversation side again, from the resend window, to ask whether it still holds it (nothing when
something of the conversation waits to be sent, or this side no longer converses); returns how many were sent. A
running relay calls it every minute for a side of the last batch each destination answered.$$;
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
    moved broker.transmission_log[];
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
    -- Taken out in one statement and put back in the next, behind the notice
    -- (positions follow the numbering): the new numbers of some may be the
    -- old numbers of others.
    WITH taken_out AS (
        DELETE FROM broker.transmission_log t
        WHERE t.conversation_handle = handle AND t.message_sequence_number > transmitted
        RETURNING t.*
    )
    SELECT array_agg(t) INTO moved FROM taken_out t;
    INSERT INTO broker.transmission_log (conversation_handle, message_sequence_number, conversation_id, to_service,
                                         message_type_id, body, priority)
    VALUES (handle, held + 1, e.conversation_id, e.far_service, renumbered.message_type_id, notice, e.priority);
    INSERT INTO broker.transmission_log (conversation_handle, message_sequence_number, conversation_id, to_service,
                                         message_type_id, body, enqueued_at, next_attempt_at, transmission_status,
                                         priority, traceparent, message_id)
    SELECT m.conversation_handle, m.message_sequence_number + shift, m.conversation_id, m.to_service,
           m.message_type_id, m.body, m.enqueued_at, m.next_attempt_at,
           format('numbered again from %s: the far node already held that number', m.message_sequence_number),
           m.priority, m.traceparent, m.message_id
    FROM unnest(moved) m
    ORDER BY m.message_sequence_number;
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
    -- A conversation held back alone is read by number once its retry is due.
    INSERT INTO broker.transmission_retries AS r (conversation_handle, to_service, priority, next_attempt_at)
    SELECT e.conversation_handle, e.far_service, e.priority, now() + retry_after
    FROM broker.endpoints e
    WHERE first_handle = last_handle AND e.conversation_handle = first_handle AND NOT e.far_is_local
    ON CONFLICT (conversation_handle) DO UPDATE SET next_attempt_at = excluded.next_attempt_at;
$$;
COMMENT ON FUNCTION broker.record_transport_failure(text, uuid, uuid, text, interval) IS $$(relay) A destination could
not be reached: the conversations of one lane of the relay (handles from `first_handle` to `last_handle`) waiting for
it get `reason` and their next attempt after `retry_after`, in one row of `transmission_failures` however many
messages wait. Failures of addresses no longer routed to are forgotten.$$;
GRANT EXECUTE ON FUNCTION broker.record_transport_failure(text,uuid,uuid,text,interval) TO broker_relay;

-- A lane's cursor stands in the log of the services routed to its address:
-- when a route is made, moved or dropped, every cursor starts again from the
-- beginning of the log, so that a service's messages that wait are read
-- wherever it is routed now (what was acknowledged is passed over).
CREATE OR REPLACE FUNCTION broker._read_the_log_again() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.transmission_cursors;
    RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER read_the_log_again AFTER INSERT OR DELETE OR UPDATE OF service_name, address
ON broker.routes FOR EACH STATEMENT EXECUTE FUNCTION broker._read_the_log_again();
