-- Least-privilege roles.
--
--   broker_application  the conversation functions an application calls and
--                       the status views: no tables, no catalog, no transport
--   broker_relay        what the relay and the transport endpoint use: the
--                       transport functions and the tables they work on
--   broker_admin        everything in the schema (what `broker serve` needs)
--
-- A login gets one of them: GRANT broker_application TO my_app_login;
--
-- What each role may execute is granted where each function is defined
-- (broker/sql/functions/); the table privileges are here.
-- tests/integration/test_roles.py checks both.

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

------------------------------------------------------------------------------
-- broker_application
------------------------------------------------------------------------------

GRANT SELECT ON broker.queue_status, broker.conversation_endpoints, broker.transmission_queue_status
    TO broker_application;

------------------------------------------------------------------------------
-- broker_relay
------------------------------------------------------------------------------

-- The transport functions run as their caller, because they read the
-- caller's temporary batch tables; so the role holds the table privileges
-- they use.
GRANT SELECT ON broker.node, broker.routes, broker.peer_secrets, broker.message_types, broker.contracts, broker.contract_message_types,
                broker.queues, broker.services, broker.service_contracts, broker.leases, broker.broker_priorities
    TO broker_relay;
-- A tracing node reports each new dead letter in its message's trace
-- (broker.tracing): what it reads of them, their bodies left out.
GRANT SELECT (dead_letter_id, queue_name, conversation_handle, message_sequence_number, reason, dead_lettered_at,
              traceparent) ON broker.dead_letters TO broker_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON broker.endpoints, broker.conversation_groups, broker.queue_messages,
                                        broker.transmission_queue, broker.transmission_failures,
                                        broker.forgotten_conversations, broker.transmission_progress,
                                        broker.acknowledged_messages, broker.lost_messages, broker.peer_retention,
                                        broker.peer_secret_use, broker.far_node_checks, broker.transmission_log,
                                        broker.transmission_cursors, broker.transmission_retries
    TO broker_relay;
GRANT USAGE, SELECT ON broker.transmission_log_position TO broker_relay;
-- Accepting a batch makes queue positions (broker._next_queue_positions).
GRANT SELECT ON broker.queue_position_base TO broker_relay;

------------------------------------------------------------------------------
-- broker_admin
------------------------------------------------------------------------------

GRANT ALL ON ALL TABLES IN SCHEMA broker TO broker_admin;
GRANT ALL ON ALL SEQUENCES IN SCHEMA broker TO broker_admin;

-- What later revisions create reaches broker_admin by itself.  Not
-- broker_relay: a new table reaches the relay only when a revision grants it.
ALTER DEFAULT PRIVILEGES IN SCHEMA broker GRANT ALL ON TABLES TO broker_admin;
ALTER DEFAULT PRIVILEGES IN SCHEMA broker GRANT ALL ON SEQUENCES TO broker_admin;
ALTER DEFAULT PRIVILEGES IN SCHEMA broker GRANT EXECUTE ON FUNCTIONS TO broker_admin;
