-- What the database holds of this definition.

-- /readyz compares the database's revision with the node's.  Alembic makes its
-- version table at its first stamp; a database built from broker/sql/ gets it
-- here, as Alembic would make it, so that there is something to grant.
CREATE TABLE IF NOT EXISTS public.broker_alembic_version (
    version_num  varchar(32) NOT NULL,
    CONSTRAINT broker_alembic_version_pkc PRIMARY KEY (version_num)
);
GRANT SELECT ON public.broker_alembic_version TO broker_admin;

-- The function files as last applied, by the SHA-256 of their text: a file is
-- applied again when it changes (broker/schema.py).
CREATE TABLE broker.function_files (
    file_name  text PRIMARY KEY,
    sha256     bytea NOT NULL
);

-- The release whose function files the database holds, and the oldest release
-- whose nodes those functions still serve: a release that changes only
-- function files needs no revision, and /readyz of a node of an earlier
-- release that they still serve says ready (api.routes.health).
CREATE TABLE broker.function_release (
    only_row     boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    release      text NOT NULL,
    serves_from  text NOT NULL
);
