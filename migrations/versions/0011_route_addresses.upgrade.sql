-- Routes name plain http(s) URLs: a host (a name, an IPv4 address or a
-- bracketed IPv6 address), an optional port and an optional path; no
-- credentials (the route's secret authenticates the peer), no query, no
-- fragment.  Frozen with revision 0011.

-- As in revision 0001, with the address checked part by part and the error
-- saying what an address may hold.
CREATE OR REPLACE FUNCTION broker.create_route(service_name text, address text, broker_instance uuid, secret text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM broker._check_name('service', service_name);
    IF address IS NULL OR length(address) > 2000
       OR address !~ '^https?://([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?(/[A-Za-z0-9._~%!$&''()*+,;=:@/-]*)?$'
       OR coalesce(substring(address FROM '^https?://[^/]*:([0-9]+)')::integer, 1) NOT BETWEEN 1 AND 65535 THEN
        PERFORM broker._raise('BR050', format('route address must be an http:// or https:// URL of a host, with an '
            'optional port and path and without credentials, query or fragment; got %s', left(quote_nullable(address), 200)));
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
