-- The Spark ingest's lock, checked where a run commits.
-- Frozen with revision 0010.
--
-- A run's lock on (queue, output) is a session advisory lock: it ends with the
-- session that took it (killed, cut, or ended by idle_session_timeout), and the
-- run is not told.  A run that went on without it could commit beside the run
-- that took the lock next, and put the same messages in the dataset twice.  So
-- a run asks broker.holds_ingest_lock on its session before it renames its
-- output into the dataset, and advance_ingest_checkpoint refuses (BR060) in the
-- transaction that advances unless the calling session holds the lock.

-- The second key of a run's advisory lock (the first is 1651663725).
CREATE FUNCTION broker._ingest_lock_key(queue text, output text) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT hashtext((broker._queue(queue)).queue_id || ' ' || output)
$$;

-- As in revision 0004, with the key from broker._ingest_lock_key.
CREATE OR REPLACE FUNCTION broker.try_lock_ingest(queue text, output text) RETURNS boolean
LANGUAGE sql AS $$
    SELECT pg_try_advisory_lock(1651663725, broker._ingest_lock_key(queue, output))
$$;

-- Whether the calling session holds the lock of a run of `queue` into `output`.
CREATE FUNCTION broker.holds_ingest_lock(queue text, output text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
          AND l.classid = 1651663725 AND l.objid = broker._ingest_lock_key(queue, output)::oid AND l.objsubid = 2)
$$;

-- As in revision 0004, refusing a session that does not hold the run's lock.
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
