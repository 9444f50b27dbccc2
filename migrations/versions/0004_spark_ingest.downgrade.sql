-- Removes what revision 0004 added.
DROP FUNCTION broker.advance_ingest_checkpoint(text, text, bigint, bigint, text, bigint, boolean);
DROP FUNCTION broker.ingest_partitions(text, bigint, bigint, integer);
DROP FUNCTION broker.start_ingest(text, text);
DROP FUNCTION broker.try_lock_ingest(text, text);
DROP VIEW broker.ingests;
DROP TABLE broker.ingest_checkpoints;
