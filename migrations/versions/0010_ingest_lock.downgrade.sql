-- Back to revision 0009: the ingest functions as revision 0004 defined them, with no lock check.

CREATE OR REPLACE FUNCTION broker.try_lock_ingest(queue text, output text) RETURNS boolean
LANGUAGE sql AS $$
    SELECT pg_try_advisory_lock(1651663725, hashtext((broker._queue(queue)).queue_id || ' ' || output))
$$;

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

DROP FUNCTION broker.holds_ingest_lock(text, text);
DROP FUNCTION broker._ingest_lock_key(text, text);
