-- Applied after the function files, whenever any is applied: PostgreSQL lets
-- PUBLIC execute every function it creates; here nothing is PUBLIC, broker_admin
-- executes everything, and the other roles what each definition grants them.
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA broker FROM PUBLIC;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA broker TO broker_admin;
