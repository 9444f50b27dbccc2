-- Removes what revision 0002 added.
DROP FUNCTION broker.record_transport_failure(text, text, interval);
DROP FUNCTION broker.apply_transport_results(jsonb);
DROP FUNCTION broker._refused_by_far_side(broker.endpoints, text);
DROP FUNCTION broker.transport_batch(text, integer);
DROP VIEW broker.transport_destinations;
DROP FUNCTION broker.accept_transport_batch(uuid, jsonb);
DROP FUNCTION broker._accept_conversation(uuid, jsonb);
DROP FUNCTION broker._accept_messages(broker.endpoints, jsonb);
DROP FUNCTION broker._create_target_endpoint(uuid, jsonb);
