-- Back to revision 0008: batches bounded by count alone.

DROP FUNCTION broker.transport_batch(text, integer, bigint, uuid, uuid);
CREATE FUNCTION broker.transport_batch(destination text, max_messages integer, first_handle uuid, last_handle uuid)
RETURNS SETOF broker.transport_message
LANGUAGE plpgsql STABLE AS $$
BEGIN  -- plpgsql rather than sql: the plan is kept between batches, not made again for each
    RETURN QUERY
    SELECT e.conversation_id, e.is_initiator, s.name, e.far_service, c.name, e.expires_at,
           due.message_sequence_number, mt.name, due.body
    FROM (SELECT t.* FROM broker.transmission_queue t
          WHERE t.conversation_handle BETWEEN first_handle AND last_handle
            AND t.to_service = ANY (ARRAY(SELECT r.service_name FROM broker.routes r WHERE r.address = destination))
            AND t.next_attempt_at <= now()
          ORDER BY t.conversation_handle, t.message_sequence_number
          LIMIT max_messages) due
    JOIN broker.endpoints e ON e.conversation_handle = due.conversation_handle
    JOIN broker.services s ON s.service_id = e.service_id
    JOIN broker.contracts c ON c.contract_id = e.contract_id
    JOIN broker.message_types mt ON mt.message_type_id = due.message_type_id;
END $$;
