-- Which releases a database serves.  A revision only adds (tables, columns,
-- functions) while nodes of the release before it still serve; what earlier
-- code needs goes only in a later revision, once no node runs that code
-- (expand, deploy, contract).  This says, by the head revision of a release's
-- code, the oldest release whose nodes may serve this database: /readyz of a
-- node whose code is older says so (api.routes.health).  A revision that
-- removes what a release uses raises it.
CREATE OR REPLACE FUNCTION broker.oldest_serving_revision() RETURNS text
LANGUAGE sql IMMUTABLE AS $$ SELECT '0029' $$;
COMMENT ON FUNCTION broker.oldest_serving_revision() IS $$(admin) The head revision of the oldest release whose nodes
may serve this database (`/readyz` reads it).$$;
