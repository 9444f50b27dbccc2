-- Internal activation (broker/sql/functions/17_activation.sql): the procedure
-- a running node calls, in a transaction of its own, while a queue has
-- messages; up to max_queue_readers calls at once, each as execute_as.
-- activations and failures count the calls that committed and those that
-- rolled back, added by the nodes about once a second.
CREATE TABLE broker.queue_activation (
    queue_id           integer PRIMARY KEY REFERENCES broker.queues ON DELETE CASCADE,
    procedure_name     text NOT NULL,
    max_queue_readers  integer NOT NULL CHECK (max_queue_readers BETWEEN 1 AND 100),
    is_enabled         boolean NOT NULL,
    execute_as         text NOT NULL,
    activations        bigint NOT NULL DEFAULT 0,
    failures           bigint NOT NULL DEFAULT 0,
    last_failure       text,
    last_failure_at    timestamptz
);

-- readers: the node sessions that hold a reader slot of the queue now (the
-- advisory lock (1633907817, queue_id * 100 + slot), see broker.take_activation_slot).
CREATE VIEW broker.activation_status AS
SELECT q.name AS queue_name, a.procedure_name, CASE WHEN a.is_enabled THEN 'on' ELSE 'off' END AS status,
       a.max_queue_readers, a.execute_as,
       (SELECT count(*) FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.classid = 1633907817 AND l.objsubid = 2 AND l.granted
          AND l.objid::bigint / 100 = q.queue_id) AS readers,
       a.activations, a.failures, a.last_failure, a.last_failure_at
FROM broker.queue_activation a
JOIN broker.queues q USING (queue_id);

-- A status view of broker_application (see 07_roles.sql).
GRANT SELECT ON broker.activation_status TO broker_application;
