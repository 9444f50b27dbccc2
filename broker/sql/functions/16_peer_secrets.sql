-- A peer's secret rotated while traffic flows, in three steps on each of the
-- two nodes (docs/operations.md, "Rotating a peer's secret"): add the new
-- secret on both, then switch on both, then retire the old one on both.  A
-- request is taken under any secret a node holds for its sender (the routes'
-- and broker.peer_secrets), and its answer signed with the secret it came
-- under, so no step refuses a batch of the peer whatever step the peer is at.

CREATE OR REPLACE FUNCTION broker._require_peer(peer uuid) RETURNS void
LANGUAGE plpgsql STABLE AS $$
BEGIN
    PERFORM broker._require('broker_instance', peer);
    IF NOT EXISTS (SELECT 1 FROM broker.routes WHERE broker_instance = peer) THEN
        PERFORM broker._raise('BR006', format('no route goes to broker instance %s', peer),
            'create the routes to that node first (broker.create_route)');
    END IF;
END $$;

-- Step 1: the new secret is taken from the peer; the routes still sign with
-- theirs.  Adding another new secret before the switch replaces it.
CREATE OR REPLACE FUNCTION broker.add_peer_secret(broker_instance uuid, secret text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._require_peer(broker_instance);
    IF secret IS NULL OR length(secret) < 16 THEN
        PERFORM broker._raise('BR050', 'the new secret must have at least 16 characters');
    END IF;
    IF EXISTS (SELECT 1 FROM broker.routes r WHERE r.broker_instance = add_peer_secret.broker_instance
               AND r.peer_secret = secret)
       OR EXISTS (SELECT 1 FROM broker.peer_secrets p WHERE p.broker_instance = add_peer_secret.broker_instance
                  AND p.secret = add_peer_secret.secret AND p.role = 'previous') THEN
        PERFORM broker._raise('BR040', 'that secret is one the node holds for this peer already: choose a new one');
    END IF;
    DELETE FROM broker.peer_secrets p WHERE p.broker_instance = add_peer_secret.broker_instance AND p.role = 'next';
    INSERT INTO broker.peer_secrets (broker_instance, secret, role) VALUES (broker_instance, secret, 'next');
END $$;
COMMENT ON FUNCTION broker.add_peer_secret(uuid, text) IS $$(admin) Rotating the secret shared with the node of
`broker_instance`, step 1 of 3, each step on both nodes: the new secret is taken from the peer from then on (the
routes still sign with the old one). BR050 under 16 characters, BR040 for a secret held already, BR006 when no route
goes to that node.$$;

-- Step 2: the routes sign with the new secret; the one they signed with
-- before is still taken from the peer.
CREATE OR REPLACE FUNCTION broker.switch_peer_secret(broker_instance uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    new_secret text;
BEGIN
    PERFORM broker._require_peer(broker_instance);
    DELETE FROM broker.peer_secrets p WHERE p.broker_instance = switch_peer_secret.broker_instance AND p.role = 'next'
    RETURNING p.secret INTO new_secret;
    IF new_secret IS NULL THEN
        PERFORM broker._raise('BR050', format('no new secret is added for broker instance %s', broker_instance),
            'add it first with broker.add_peer_secret, on this node and on the peer');
    END IF;
    INSERT INTO broker.peer_secrets (broker_instance, secret, role)
    SELECT DISTINCT r.broker_instance, r.peer_secret, 'previous' FROM broker.routes r
    WHERE r.broker_instance = switch_peer_secret.broker_instance
    ON CONFLICT ON CONSTRAINT peer_secrets_pkey DO UPDATE SET role = 'previous', added_at = now();
    UPDATE broker.routes r SET peer_secret = new_secret WHERE r.broker_instance = switch_peer_secret.broker_instance;
END $$;
COMMENT ON FUNCTION broker.switch_peer_secret(uuid) IS $$(admin) Rotating a peer's secret, step 2 of 3, on both nodes:
the routes to the node of `broker_instance` sign with the new secret, and the old one is still taken. BR050 when none
was added, BR006 when no route goes to that node.$$;

-- Step 3: the old secret is no longer taken.  Returns how many secrets went
-- (0 when there was none to retire).
CREATE OR REPLACE FUNCTION broker.retire_peer_secret(broker_instance uuid) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    retired text[];
BEGIN
    PERFORM broker._require_peer(broker_instance);
    WITH gone AS (
        DELETE FROM broker.peer_secrets p
        WHERE p.broker_instance = retire_peer_secret.broker_instance AND p.role = 'previous'
        RETURNING p.secret)
    SELECT coalesce(array_agg(gone.secret), '{}') INTO retired FROM gone;
    DELETE FROM broker.peer_secret_use u
    WHERE u.broker_instance = retire_peer_secret.broker_instance
      AND u.secret_sha256 IN (SELECT sha256(convert_to(r, 'UTF8')) FROM unnest(retired) r);
    RETURN cardinality(retired);
END $$;
COMMENT ON FUNCTION broker.retire_peer_secret(uuid) IS $$(admin) Rotating a peer's secret, step 3 of 3, on both nodes:
the old secret is no longer taken from the node of `broker_instance`. Returns how many secrets went (0 when there was
none to retire); BR006 when no route goes to that node.$$;
