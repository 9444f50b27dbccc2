-- Service Broker's tutorial "Completing a Conversation Using Internal
-- Activation" in PL/pgSQL: a target queue whose activated procedure receives
-- a request, replies, and ends its side of the conversation on EndDialog or
-- Error.  The node (broker serve) calls the procedure while the queue has
-- messages, each call in a transaction of its own.
SELECT broker.create_message_type('//AWDB/InternalAct/RequestMessage');
SELECT broker.create_message_type('//AWDB/InternalAct/ReplyMessage');
SELECT broker.create_contract('//AWDB/InternalAct/SampleContract',
    '{"//AWDB/InternalAct/RequestMessage": "initiator", "//AWDB/InternalAct/ReplyMessage": "target"}');
SELECT broker.create_queue('TargetQueueIntAct');
SELECT broker.create_service('//AWDB/InternalAct/TargetService', 'TargetQueueIntAct',
                             ARRAY['//AWDB/InternalAct/SampleContract']);
SELECT broker.create_queue('InitiatorQueueIntAct');
SELECT broker.create_service('//AWDB/InternalAct/InitiatorService', 'InitiatorQueueIntAct');

CREATE PROCEDURE target_activ_proc(queue text)
LANGUAGE plpgsql AS $$
DECLARE
    received record;
BEGIN
    FOR received IN SELECT * FROM broker.receive(queue, 1) LOOP
        IF received.message_type = '//AWDB/InternalAct/RequestMessage' THEN
            PERFORM broker.send(received.conversation_handle, '//AWDB/InternalAct/ReplyMessage',
                                convert_to('<ReplyMsg>Message for Initiator service.</ReplyMsg>', 'UTF8'));
        ELSIF received.message_type IN ('broker.end_dialog', 'broker.error') THEN
            PERFORM broker.end_conversation(received.conversation_handle);
        END IF;
    END LOOP;
END $$;

-- The procedure runs as a role of the application, never as a superuser.
DO $$
BEGIN
    CREATE ROLE target_activation NOLOGIN;
EXCEPTION WHEN duplicate_object THEN
    NULL;
END $$;
GRANT broker_application TO target_activation;
GRANT EXECUTE ON PROCEDURE target_activ_proc(text) TO target_activation;

SELECT broker.set_queue_activation('TargetQueueIntAct', 'target_activ_proc', max_queue_readers => 10,
                                   execute_as => 'target_activation');
