-- API keys of the REST API.

------------------------------------------------------------------------------
-- API keys
------------------------------------------------------------------------------

-- A key is "bk_<key_id>_<secret>"; only the secret's SHA-256 is kept.  The
-- secret is 256 random bits, so a fast hash is enough: there is nothing to
-- guess by brute force.
CREATE TABLE broker.api_keys (
    key_id         text PRIMARY KEY,
    name           text NOT NULL,
    secret_sha256  bytea NOT NULL,
    scopes         text[] NOT NULL CHECK (cardinality(scopes) > 0),
    created_at     timestamptz NOT NULL DEFAULT now(),
    revoked_at     timestamptz
);
