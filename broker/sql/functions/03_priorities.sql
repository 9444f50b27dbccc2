-- Broker priorities (Service Broker's CREATE BROKER PRIORITY): the priority a
-- conversation takes when it begins, from its contract and services.

------------------------------------------------------------------------------
-- Priorities
------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION broker.create_broker_priority(name text, priority integer, contract text DEFAULT NULL,
                                              local_service text DEFAULT NULL, remote_service text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._check_name('broker priority', name);
    IF priority IS NULL OR priority NOT BETWEEN 1 AND 10 THEN
        PERFORM broker._raise('BR050', format('priority must be 1 to 10, got %s', coalesce(priority::text, 'NULL')));
    END IF;
    INSERT INTO broker.broker_priorities
    VALUES (name, priority,
            CASE WHEN contract IS NOT NULL THEN broker._check_name('contract', contract) END,
            CASE WHEN local_service IS NOT NULL THEN broker._check_name('service', local_service) END,
            CASE WHEN remote_service IS NOT NULL THEN broker._check_name('service', remote_service) END);
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('broker priority %L, or one for the same contract and services, already exists',
        name));
END $$;
COMMENT ON FUNCTION broker.create_broker_priority(text, integer, text, text, text) IS $$(admin) Service Broker's
`CREATE BROKER PRIORITY`: conversation sides created from then on for `contract` between `local_service` and
`remote_service` (NULL: any) get `priority` (1 to 10; 5 without a match), the most specific match winning: contract,
then local service, then remote service. Receive hands out the groups of the highest priority first, and the relay
sends a destination's messages of the highest priority first; each conversation stays in order. BR050 for a priority
outside 1–10, BR040 for a name or a match that exists.$$;

CREATE OR REPLACE FUNCTION broker.drop_broker_priority(name text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.broker_priorities p WHERE p.name = drop_broker_priority.name;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR005', format('unknown broker priority %L', name));
    END IF;
END $$;
COMMENT ON FUNCTION broker.drop_broker_priority(text) IS $$(admin) Drops a broker priority; a conversation side keeps
the priority it got. BR005 for an unknown name.$$;

-- The priority of a new conversation side (see broker.broker_priorities).
-- plpgsql rather than sql: its plan is kept for the session; as sql it was
-- planned again in each begin_dialog, which then took twice as long.
CREATE OR REPLACE FUNCTION broker._priority(contract text, local_service text, remote_service text) RETURNS smallint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN coalesce((SELECT p.priority FROM broker.broker_priorities p
                     WHERE coalesce(p.contract_name = contract, true)
                       AND coalesce(p.local_service_name = local_service, true)
                       AND coalesce(p.remote_service_name = remote_service, true)
                     ORDER BY p.contract_name IS NULL, p.local_service_name IS NULL, p.remote_service_name IS NULL
                     LIMIT 1), 5::smallint);
END $$;
GRANT EXECUTE ON FUNCTION broker._priority(text,text,text) TO broker_relay;
