-- Batches bounded by bytes as well as by count, so that any backlog drains:
-- a destination refuses a request over its size limit, and a batch of the
-- same messages would be refused again at every retry.  Frozen with revision
-- 0009.

-- As in revision 0006, with the batch cut where its bodies and headers reach
-- max_bytes.  The first message always goes, whatever its size, so that a
-- message at the size limit still travels alone.  A message's share is its
-- body and the texts that travel with it, plus 80 bytes for the fixed-size
-- fields and lengths of its row in the binary COPY format.
DROP FUNCTION broker.transport_batch(text, integer, uuid, uuid);
CREATE FUNCTION broker.transport_batch(destination text, max_messages integer, max_bytes bigint,
                                       first_handle uuid, last_handle uuid)
RETURNS SETOF broker.transport_message
LANGUAGE plpgsql STABLE AS $$
BEGIN  -- plpgsql rather than sql: the plan is kept between batches, not made again for each
    RETURN QUERY
    SELECT sized.conversation_id, sized.is_initiator, sized.from_service, sized.to_service, sized.contract,
           sized.expires_at, sized.sequence_number, sized.message_type, sized.body
    FROM (SELECT e.conversation_id, e.is_initiator, s.name AS from_service, e.far_service AS to_service,
                 c.name AS contract, e.expires_at, due.message_sequence_number AS sequence_number,
                 mt.name AS message_type, due.body,
                 sum(80 + coalesce(octet_length(due.body), 0) + octet_length(s.name) + octet_length(e.far_service)
                     + octet_length(c.name) + octet_length(mt.name))
                     OVER (ORDER BY due.conversation_handle, due.message_sequence_number) AS bytes_so_far,
                 row_number() OVER (ORDER BY due.conversation_handle, due.message_sequence_number) AS place
          FROM (SELECT t.* FROM broker.transmission_queue t
                WHERE t.conversation_handle BETWEEN first_handle AND last_handle
                  AND t.to_service = ANY (ARRAY(SELECT r.service_name FROM broker.routes r
                                                WHERE r.address = destination))
                  AND t.next_attempt_at <= now()
                ORDER BY t.conversation_handle, t.message_sequence_number
                LIMIT max_messages) due
          JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle
          JOIN broker.services s ON s.service_id = e.service_id
          JOIN broker.contracts c ON c.contract_id = e.contract_id
          JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id) sized
    WHERE sized.place = 1 OR sized.bytes_so_far <= max_bytes
    ORDER BY sized.place;
END $$;
COMMENT ON FUNCTION broker.transport_batch(text, integer, bigint, uuid, uuid) IS
    'The next batch for a destination: the lowest waiting numbers of its conversations between the handles, up to a count and a size.';
