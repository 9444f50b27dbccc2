-- Least-privilege roles.
--
--   broker_application  the conversation functions an application calls and
--                       three status views: no tables, no catalog, no transport
--   broker_relay        what the relay and the transport endpoint use: the
--                       transport functions and the tables they work on
--   broker_admin        everything in the schema (what `broker serve` needs)
--
-- A login gets one of them: GRANT broker_application TO my_app_login;
--
-- The application's functions run as their owner (SECURITY DEFINER) with a
-- pinned search_path, so its role needs no table privileges.  In a revision, a
-- CREATE OR REPLACE FUNCTION of one of them resets both, and a new function is
-- executable by PUBLIC: the revision that does either says them again
-- (tests/integration/test_roles.py checks).

-- Roles belong to the cluster, and every broker database makes them: each
-- is made only when missing (another database may be making it right now).
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['broker_application', 'broker_relay', 'broker_admin'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
END $$;

GRANT USAGE ON SCHEMA broker TO broker_application, broker_relay, broker_admin;

-- PostgreSQL lets PUBLIC execute every function it creates; here only the roles may.
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA broker FROM PUBLIC;

------------------------------------------------------------------------------
-- broker_application
------------------------------------------------------------------------------

-- Every overload of the application's entry points.  report_processing_failure
-- is one: the activation worker calls it after a handler fails.
DO $$
DECLARE
    entry_point regprocedure;
BEGIN
    FOR entry_point IN
        SELECT p.oid FROM pg_proc p
        WHERE p.pronamespace = 'broker'::regnamespace
          AND p.proname IN ('begin_dialog', 'send', 'send_numbered', 'send_numbered_batch', 'send_batch', 'receive',
                            'receive_with_lock', 'complete_lock', 'abandon_lock', 'renew_lock',
                            'get_conversation_group', 'move_conversation', 'end_conversation',
                            'get_conversation_group_state', 'set_conversation_group_state', 'dead_letter_conversation',
                            'begin_conversation_timer', 'report_processing_failure')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = broker, pg_catalog, pg_temp', entry_point);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO broker_application', entry_point);
    END LOOP;
END $$;

GRANT SELECT ON broker.queue_status, broker.conversation_endpoints, broker.transmission_queue_status
    TO broker_application;

------------------------------------------------------------------------------
-- broker_relay
------------------------------------------------------------------------------

-- The transport functions run as their caller, because they read the
-- caller's temporary batch tables; so the role holds the table privileges
-- they use.  The helpers (names starting with "_") run as their caller too:
-- executing them allows nothing beyond those tables.
DO $$
DECLARE
    function_id regprocedure;
BEGIN
    FOR function_id IN
        SELECT p.oid FROM pg_proc p
        WHERE p.pronamespace = 'broker'::regnamespace
          AND (p.proname IN ('transport_batch', 'apply_transport_results', 'record_transport_failure',
                             'accept_transport_batch', 'forget_closed_endpoints', 'forget_acknowledged_messages',
                             'withhold_what_peers_forgot', 'fire_due_events')
               OR left(p.proname, 1) = '_')
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO broker_relay', function_id);
    END LOOP;
END $$;

-- The node counts the rollbacks that readers did not report (see
-- broker.count_unreported_rollbacks), which can quarantine: that writes the
-- dead letters, which the relay's role does not hold, so it runs as its owner.
ALTER FUNCTION broker.count_unreported_rollbacks(interval, integer) SECURITY DEFINER
    SET search_path = broker, pg_catalog, pg_temp;
GRANT EXECUTE ON FUNCTION broker.count_unreported_rollbacks(interval, integer) TO broker_relay;
-- So does withholding what a peer may have forgotten (broker.withhold_what_peers_forgot).
ALTER FUNCTION broker.withhold_what_peers_forgot(interval) SECURITY DEFINER
    SET search_path = broker, pg_catalog, pg_temp;

GRANT SELECT ON broker.node, broker.routes, broker.message_types, broker.contracts, broker.contract_message_types,
                broker.queues, broker.services, broker.service_contracts, broker.leases, broker.broker_priorities
    TO broker_relay;
-- A tracing node reports each new dead letter in its message's trace
-- (broker.tracing): what it reads of them, their bodies left out.
GRANT SELECT (dead_letter_id, queue_name, conversation_handle, message_sequence_number, reason, dead_lettered_at,
              traceparent) ON broker.dead_letters TO broker_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON broker.endpoints, broker.conversation_groups, broker.queue_messages,
                                        broker.transmission_queue, broker.transmission_failures,
                                        broker.forgotten_conversations, broker.transmission_progress,
                                        broker.acknowledged_messages, broker.lost_messages, broker.peer_retention
    TO broker_relay;

------------------------------------------------------------------------------
-- broker_admin
------------------------------------------------------------------------------

GRANT ALL ON ALL TABLES IN SCHEMA broker TO broker_admin;
GRANT ALL ON ALL SEQUENCES IN SCHEMA broker TO broker_admin;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA broker TO broker_admin;
-- /readyz compares the database's revision with the node's.  Alembic makes its
-- version table at its first stamp; a database built from these files gets it
-- here, as Alembic would make it, so that there is something to grant.
CREATE TABLE IF NOT EXISTS public.broker_alembic_version (
    version_num  varchar(32) NOT NULL,
    CONSTRAINT broker_alembic_version_pkc PRIMARY KEY (version_num)
);
GRANT SELECT ON public.broker_alembic_version TO broker_admin;

-- What later revisions create reaches broker_admin by itself.  Not
-- broker_relay: a new table reaches the relay only when a revision grants it.
ALTER DEFAULT PRIVILEGES IN SCHEMA broker GRANT ALL ON TABLES TO broker_admin;
ALTER DEFAULT PRIVILEGES IN SCHEMA broker GRANT ALL ON SEQUENCES TO broker_admin;
ALTER DEFAULT PRIVILEGES IN SCHEMA broker GRANT EXECUTE ON FUNCTIONS TO broker_admin;
