-- Back to revision 0010: the address checked as in revision 0001.

CREATE OR REPLACE FUNCTION broker.create_route(service_name text, address text, broker_instance uuid, secret text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._check_name('service', service_name);
    IF address IS NULL OR address !~ '^https?://[^\s/]+(/\S*)?$' OR length(address) > 2000 THEN
        PERFORM broker._raise('BR050', format('route address must be an http:// or https:// URL, got %s',
            left(quote_nullable(address), 200)));
    END IF;
    PERFORM broker._require('broker_instance', broker_instance);
    IF secret IS NULL OR length(secret) < 16 THEN
        PERFORM broker._raise('BR050', 'the route''s secret must have at least 16 characters');
    END IF;
    INSERT INTO broker.routes (service_name, address, broker_instance, peer_secret)
    VALUES (create_route.service_name, rtrim(create_route.address, '/'), create_route.broker_instance, secret);
EXCEPTION WHEN unique_violation THEN
    PERFORM broker._raise('BR040', format('a route for service %L already exists', service_name));
END $$;
