-- Removes what revision 0002 added and restores revision 0001's create_route.
DROP FUNCTION broker.record_transport_failure(text, text, interval);
DROP FUNCTION broker.apply_transport_results(text, jsonb);
DROP FUNCTION broker._refused_by_far_side(broker.endpoints, text);
DROP FUNCTION broker.transport_batch(text, integer);
DROP VIEW broker.transport_destinations;
DROP FUNCTION broker.accept_transport_batch(uuid, jsonb);
DROP FUNCTION broker._accept_conversation(uuid, jsonb);
DROP FUNCTION broker._accept_messages(broker.endpoints, jsonb);
DROP FUNCTION broker._create_target_endpoint(uuid, jsonb);
DROP FUNCTION broker.create_route(text, text, uuid, text);
DROP INDEX broker.routes_address;
DROP INDEX broker.routes_broker_instance;
ALTER TABLE broker.routes DROP COLUMN peer_secret;

CREATE FUNCTION broker.create_route(service_name text, address text, broker_instance uuid DEFAULT NULL) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._check_name('service', service_name);
    IF address IS NULL OR address !~ '^https?://[^\s/]+(/\S*)?$' OR length(address) > 2000 THEN
        PERFORM broker._raise('BR050', format('route address must be an http:// or https:// URL, got %s',
            left(quote_nullable(address), 200)));
    END IF;
    INSERT INTO broker.routes (service_name, address, broker_instance)
    VALUES (create_route.service_name, create_route.address, create_route.broker_instance);
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('a route for service %L already exists', service_name));
END $$;
