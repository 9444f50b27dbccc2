-- Back to conversation groups without state (revision 0021).

DROP FUNCTION broker.set_conversation_group_state(uuid, jsonb, uuid);
DROP FUNCTION broker.get_conversation_group_state(uuid, uuid);
DROP FUNCTION broker._hold_group(uuid, uuid);
DROP TABLE broker.conversation_group_state;
