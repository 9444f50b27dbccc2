-- For the Spark ingest: the functions a run calls to fix its range, plan its
-- partitions and commit (see broker/sql/schema/06_ingest.sql).

-- The second key of a run's advisory lock (the first is 1651663725).
CREATE OR REPLACE FUNCTION broker._ingest_lock_key(queue text, output text) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT hashtext((broker._queue(queue)).queue_id || ' ' || output)
$$;
GRANT EXECUTE ON FUNCTION broker._ingest_lock_key(text,text) TO broker_relay;

-- Holds off a second run into the same output for as long as the calling
-- session lives (a killed run's session ends, and its lock with it).  The
-- lock's second key is broker._ingest_lock_key's.
CREATE OR REPLACE FUNCTION broker.try_lock_ingest(queue text, output text) RETURNS boolean
LANGUAGE sql AS $$
    SELECT pg_try_advisory_lock(1651663725, broker._ingest_lock_key(queue, output))
$$;
COMMENT ON FUNCTION broker.try_lock_ingest(text, text) IS $$(ingest) Takes the lock of a run of `queue` into `output`
for the calling session (a session advisory lock, held until the session ends), so that no second run ingests into
that output meanwhile; false when another session holds it.$$;

-- Whether the calling session holds the lock of a run of `queue` into `output`.
CREATE OR REPLACE FUNCTION broker.holds_ingest_lock(queue text, output text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
          AND l.classid = 1651663725 AND l.objid = broker._ingest_lock_key(queue, output)::oid AND l.objsubid = 2)
$$;
COMMENT ON FUNCTION broker.holds_ingest_lock(text, text) IS $$(ingest) Whether the calling session holds the lock of a
run of `queue` into `output` (`try_lock_ingest`).$$;

-- Starts a run: the checkpoint (0 for a new output) and the high-water mark.
CREATE OR REPLACE FUNCTION broker.start_ingest(queue text, output text, OUT after_position bigint, OUT up_to_position bigint)
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    horizon bigint := broker.committed_position_horizon();
BEGIN
    INSERT INTO broker.ingest_checkpoints (queue_id, output)
    VALUES (q.queue_id, broker._require('output', output))
    ON CONFLICT DO NOTHING;
    SELECT c.queue_position INTO after_position
    FROM broker.ingest_checkpoints c WHERE c.queue_id = q.queue_id AND c.output = start_ingest.output;
    up_to_position := greatest(after_position, horizon - 1);
END $$;
COMMENT ON FUNCTION broker.start_ingest(text, text) IS $$(ingest) Starts a run of `queue` into `output`: returns its
checkpoint (`after_position`; 0 for a new output) and the high-water mark below `committed_position_horizon()`
(`up_to_position`).$$;

-- Splits the rows in (after_position, up_to_position] into up to `partitions`
-- consecutive ranges of nearly equal row counts: the last position of each,
-- and its row count.  Positions cluster by transaction, so equal-width ranges
-- would not balance.
CREATE OR REPLACE FUNCTION broker.ingest_partitions(queue text, after_position bigint, up_to_position bigint, partitions integer)
RETURNS TABLE (last_position bigint, row_count bigint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    q broker.queues := broker._queue(queue);
BEGIN
    IF broker._require('partitions', partitions) < 1 THEN
        PERFORM broker._raise('BR050', 'partitions must be at least 1');
    END IF;
    RETURN QUERY
    SELECT max(p.queue_position), count(*)
    FROM (SELECT m.queue_position, ntile(partitions) OVER (ORDER BY m.queue_position) AS part
          FROM broker.queue_messages m
          WHERE m.queue_id = q.queue_id
            AND m.queue_position > broker._require('after_position', after_position)
            AND m.queue_position <= broker._require('up_to_position', up_to_position)) p
    GROUP BY p.part
    ORDER BY p.part;
END $$;
COMMENT ON FUNCTION broker.ingest_partitions(text, bigint, bigint, integer) IS $$(ingest) Splits the rows in
(`after_position`, `up_to_position`] into up to `partitions` consecutive ranges of nearly equal row counts: the last
position of each, and its row count. BR050 for fewer than 1 partition.$$;

-- Commits a run: moves the checkpoint from after_position to up_to_position,
-- and with `consume` deletes the rows in that range in the same transaction.
-- Returns the number of rows deleted.  Refuses (BR060) a session that does not
-- hold the run's lock.
CREATE OR REPLACE FUNCTION broker.advance_ingest_checkpoint(queue text, output text, after_position bigint,
                                                            up_to_position bigint, run text, rows_ingested bigint,
                                                            consume boolean DEFAULT false) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    checkpoint bigint;
    deleted bigint := 0;
BEGIN
    IF broker._require('up_to_position', up_to_position) < broker._require('after_position', after_position) THEN
        PERFORM broker._raise('BR050', 'up_to_position must not be below after_position');
    END IF;
    IF NOT broker.holds_ingest_lock(queue, broker._require('output', output)) THEN
        PERFORM broker._raise('BR060', format('the ingest of queue %L into %L is not locked by this session',
            queue, output),
            'a run advances the checkpoint on the session that took broker.try_lock_ingest, and only while it lives');
    END IF;
    SELECT c.queue_position INTO checkpoint
    FROM broker.ingest_checkpoints c WHERE c.queue_id = q.queue_id AND c.output = advance_ingest_checkpoint.output
    FOR UPDATE;
    IF checkpoint IS DISTINCT FROM after_position THEN
        PERFORM broker._raise('BR070', format('the ingest of queue %L into %L is at position %s, not %s',
            queue, output, coalesce(checkpoint::text, 'none'), after_position),
            'another run moved the checkpoint; run the ingest again');
    END IF;
    UPDATE broker.ingest_checkpoints c
    SET queue_position = up_to_position, last_run = run,
        rows_ingested = c.rows_ingested + broker._require('rows_ingested', advance_ingest_checkpoint.rows_ingested),
        runs = c.runs + 1, updated_at = now()
    WHERE c.queue_id = q.queue_id AND c.output = advance_ingest_checkpoint.output;
    IF broker._require('consume', consume) THEN
        DELETE FROM broker.queue_messages m
        WHERE m.queue_id = q.queue_id AND m.queue_position > after_position AND m.queue_position <= up_to_position;
        GET DIAGNOSTICS deleted = ROW_COUNT;
    END IF;
    RETURN deleted;
END $$;
COMMENT ON FUNCTION broker.advance_ingest_checkpoint(text, text, bigint, bigint, text, bigint, boolean) IS $$(ingest)
Commits a run: moves the checkpoint from `after_position` to `up_to_position`, counting the run and `rows_ingested`,
and with `consume` deletes the rows in that range in the same transaction; returns how many it deleted. Advancing from
anywhere but the checkpoint is BR070 (another run moved it), and from a session that does not hold the run's lock
(`try_lock_ingest`) BR060.$$;

-- How far each ingest is behind its queue: the messages above its checkpoint
-- (committed, and still in the queue), and how long the oldest of them has
-- waited, 0 when none does.  What `broker status`, /metrics and the console
-- show, and what `broker ingest --follow` logs after each run.
CREATE OR REPLACE FUNCTION broker.ingest_lag()
RETURNS TABLE (queue_name text, output text, lag_messages bigint, lag_s float8)
LANGUAGE sql STABLE AS $$
    SELECT q.name, c.output, waiting.messages,
           greatest(coalesce(extract(epoch FROM now() - waiting.oldest), 0), 0)::float8
    FROM broker.ingest_checkpoints c
    JOIN broker.queues q USING (queue_id)
    CROSS JOIN LATERAL (SELECT count(*) AS messages, min(m.enqueued_at) AS oldest
                        FROM broker.queue_messages m
                        WHERE m.queue_id = c.queue_id AND m.queue_position > c.queue_position) waiting
    ORDER BY q.name, c.output
$$;
COMMENT ON FUNCTION broker.ingest_lag() IS $$(ingest) Each ingest's lag: the messages above its checkpoint, and the
age in seconds of the oldest (0 when none wait). What `broker status`, `/metrics` and the console show, and what
`broker ingest --follow` logs after each run.$$;
