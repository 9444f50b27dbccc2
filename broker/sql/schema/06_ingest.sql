-- For the Spark ingest: a checkpoint per (queue, output dataset).
--
-- A run reads the positions in (checkpoint, high-water mark], where the
-- high-water mark lies below broker.committed_position_horizon(): every row in
-- that range was written by a finished transaction, so none can appear in it
-- later (invariant 6).  The run writes its output, and only then advances the
-- checkpoint, which is what makes each message land in the output exactly once.
--
-- A run's lock on (queue, output) is a session advisory lock: it ends with the
-- session that took it (killed, cut, or ended by idle_session_timeout), and the
-- run is not told.  A run that went on without it could commit beside the run
-- that took the lock next, and put the same messages in the dataset twice.  So
-- a run asks broker.holds_ingest_lock on its session before it renames its
-- output into the dataset, and advance_ingest_checkpoint refuses (BR060) in the
-- transaction that advances unless the calling session holds the lock.

-- What a bulk reader (the Spark ingest) reads: the committed destination queue.
CREATE VIEW broker.destination_queue AS
SELECT q.name AS queue_name, m.queue_position, m.conversation_id, m.conversation_handle,
       m.conversation_group_id, m.message_sequence_number, s.name AS service_name,
       c.name AS contract_name, mt.name AS message_type, mt.validation, m.body, m.enqueued_at, m.received_at
FROM broker.queue_messages m
JOIN broker.queues q ON q.queue_id = m.queue_id
JOIN broker.endpoints e ON e.conversation_handle = m.conversation_handle
JOIN broker.services s ON s.service_id = e.service_id
JOIN broker.contracts c ON c.contract_id = e.contract_id
JOIN broker.message_types mt ON mt.message_type_id = m.message_type_id;

CREATE TABLE broker.ingest_checkpoints (
    queue_id        integer NOT NULL REFERENCES broker.queues ON DELETE CASCADE,
    output          text NOT NULL CHECK (output <> ''),
    -- Every row of the queue at or below this position is in the output.
    queue_position  bigint NOT NULL DEFAULT 0,
    last_run        text,
    rows_ingested   bigint NOT NULL DEFAULT 0,
    runs            bigint NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue_id, output)
);

CREATE VIEW broker.ingests AS
SELECT q.name AS queue_name, c.output, c.queue_position, c.last_run, c.rows_ingested, c.runs, c.updated_at
FROM broker.ingest_checkpoints c
JOIN broker.queues q USING (queue_id);
