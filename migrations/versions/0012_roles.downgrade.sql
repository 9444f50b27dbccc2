-- Back to revision 0011: no grants, every function executable by PUBLIC and
-- run as its caller.  The roles stay: they belong to the cluster, other
-- databases may still use them, and DROP ROLE refuses while any does.

ALTER DEFAULT PRIVILEGES IN SCHEMA broker REVOKE ALL ON TABLES FROM broker_admin;
ALTER DEFAULT PRIVILEGES IN SCHEMA broker REVOKE ALL ON SEQUENCES FROM broker_admin;
ALTER DEFAULT PRIVILEGES IN SCHEMA broker REVOKE EXECUTE ON FUNCTIONS FROM broker_admin;
REVOKE SELECT ON public.broker_alembic_version FROM broker_admin;

DO $$
DECLARE
    entry_point regprocedure;
BEGIN
    FOR entry_point IN
        SELECT p.oid FROM pg_proc p WHERE p.pronamespace = 'broker'::regnamespace AND p.prosecdef
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY INVOKER RESET search_path', entry_point);
    END LOOP;
END $$;

REVOKE ALL ON ALL TABLES IN SCHEMA broker FROM broker_application, broker_relay, broker_admin;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA broker FROM broker_application, broker_relay, broker_admin;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA broker FROM broker_application, broker_relay, broker_admin;
REVOKE USAGE ON SCHEMA broker FROM broker_application, broker_relay, broker_admin;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA broker TO PUBLIC;
