-- The broker's tables, types and views, in file order; its functions are in
-- broker/sql/functions/.  A new database is built from both (broker/schema.py).
-- An existing one is upgraded by the revisions in migrations/versions, which
-- change only what is here; then the function files that changed are applied
-- again.  tests/migrations/test_schema_definition.py checks that both ways
-- build the same.
--
-- This file: the schema and the catalog (the node, message types, contracts,
-- queues, services, routes).

CREATE SCHEMA broker;

------------------------------------------------------------------------------
-- Catalog
------------------------------------------------------------------------------

-- The local node: one row.  Closed conversation endpoints are forgotten after
-- closed_endpoint_retention; the tombstones of remote ones after
-- tombstone_retention (see functions/14_forgetting.sql).  Messages sent to
-- another node are kept in the transmission log for resend_window, to send
-- again to a peer whose database went back to an earlier point (see
-- broker.transmission_log).
CREATE TABLE broker.node (
    singleton                  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    broker_instance            uuid NOT NULL DEFAULT gen_random_uuid(),
    max_message_bytes          integer NOT NULL DEFAULT 16777216 CHECK (max_message_bytes > 0),
    closed_endpoint_retention  interval NOT NULL DEFAULT '30 minutes'
                                   CHECK (closed_endpoint_retention >= interval '0'),
    tombstone_retention        interval NOT NULL DEFAULT '90 days'
                                   CHECK (tombstone_retention >= interval '1 day'),
    resend_window              interval NOT NULL DEFAULT '24 hours' CHECK (resend_window >= interval '0')
);
INSERT INTO broker.node DEFAULT VALUES;

CREATE TABLE broker.message_types (
    message_type_id  serial PRIMARY KEY,
    name             text NOT NULL UNIQUE,
    validation       text NOT NULL CHECK (validation IN ('none', 'empty', 'json'))
);
INSERT INTO broker.message_types (name, validation) VALUES
    ('broker.end_dialog', 'empty'),
    ('broker.error', 'json'),
    ('broker.dialog_timer', 'empty'),
    ('broker.renumbered', 'json');  -- see broker._number_past

CREATE TABLE broker.contracts (
    contract_id  serial PRIMARY KEY,
    name         text NOT NULL UNIQUE
);

CREATE TABLE broker.contract_message_types (
    contract_id      integer NOT NULL REFERENCES broker.contracts ON DELETE CASCADE,
    message_type_id  integer NOT NULL REFERENCES broker.message_types,
    sent_by          text NOT NULL CHECK (sent_by IN ('initiator', 'target', 'any')),
    PRIMARY KEY (contract_id, message_type_id)
);

-- The message types each side of each contract may send that are stored
-- without a second look: application types without validation.  A message
-- of such a type within the size limit is "plain": broker.send_batch and
-- broker.accept_transport_batch take plain messages in bulk.
CREATE VIEW broker._plain_message_types AS
SELECT cmt.contract_id, side.sent_by_initiator, t.name, t.message_type_id
FROM broker.contract_message_types cmt
JOIN broker.message_types t USING (message_type_id)
CROSS JOIN (VALUES (true), (false)) AS side(sent_by_initiator)
WHERE t.validation = 'none' AND t.name NOT LIKE 'broker.%'
  AND cmt.sent_by IN ('any', CASE WHEN side.sent_by_initiator THEN 'initiator' ELSE 'target' END);

CREATE TABLE broker.queues (
    queue_id          serial PRIMARY KEY,
    name              text NOT NULL UNIQUE,
    is_enabled        boolean NOT NULL DEFAULT true,
    retention         boolean NOT NULL DEFAULT false,
    poison_threshold  integer NOT NULL DEFAULT 5 CHECK (poison_threshold > 0),
    created_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE broker.services (
    service_id  serial PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    queue_id    integer NOT NULL REFERENCES broker.queues
);

-- Contracts a service accepts as a target.
CREATE TABLE broker.service_contracts (
    service_id   integer NOT NULL REFERENCES broker.services ON DELETE CASCADE,
    contract_id  integer NOT NULL REFERENCES broker.contracts,
    PRIMARY KEY (service_id, contract_id)
);

-- peer_secret is shared with the peer node: requests and answers are signed
-- with HMAC-SHA256 under it, so it cannot be kept as a hash.
CREATE TABLE broker.routes (
    route_id         serial PRIMARY KEY,
    service_name     text NOT NULL UNIQUE,
    address          text NOT NULL,
    broker_instance  uuid NOT NULL,
    peer_secret      text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX routes_address ON broker.routes (address);
CREATE INDEX routes_broker_instance ON broker.routes (broker_instance);

-- A peer's secret while it is rotated (docs/how-to/rotate-a-secret.md): a
-- 'next' secret is taken from the peer but not yet signed with;
-- broker.switch_peer_secret makes the routes sign with it and keeps the one
-- they signed with before as 'previous', still taken from the peer until
-- broker.retire_peer_secret.  A request is taken under any secret of the
-- routes to its sender or of these.
CREATE TABLE broker.peer_secrets (
    broker_instance  uuid NOT NULL,
    secret           text NOT NULL,
    role             text NOT NULL CHECK (role IN ('next', 'previous')),
    added_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (broker_instance, secret)
);
CREATE UNIQUE INDEX peer_secrets_next ON broker.peer_secrets (broker_instance) WHERE role = 'next';

-- Which secret each peer signs its batches with, by the secret's SHA-256,
-- and when it last did (to ten seconds): `broker diagnose` says which one
-- each peer uses, and warns while one still signs with a secret on its way
-- out.
CREATE TABLE broker.peer_secret_use (
    broker_instance  uuid NOT NULL,
    secret_sha256    bytea NOT NULL,
    last_used_at     timestamptz NOT NULL,
    PRIMARY KEY (broker_instance, secret_sha256)
);
