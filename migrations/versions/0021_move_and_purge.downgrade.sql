-- Back to conversations that stay in their group and queues that are not purged (revision 0020).

DROP FUNCTION broker.purge_queue(text);
DROP FUNCTION broker.move_conversation(uuid, uuid);
