-- A conversation from psql alone: define the catalog, converse, end, check.
-- Run with: psql -v ON_ERROR_STOP=1 -f tests/sql/scenario.sql <database URL>
\set ON_ERROR_STOP on

SELECT broker.create_message_type('expense.claim', 'json');
SELECT broker.create_message_type('expense.approved', 'empty');
SELECT broker.create_contract('expenses', '{"expense.claim": "initiator", "expense.approved": "target"}');
SELECT broker.create_queue('employee_queue');
SELECT broker.create_queue('accounts_queue');
SELECT broker.create_service('//hr/employee', 'employee_queue');
SELECT broker.create_service('//finance/accounts', 'accounts_queue', ARRAY['expenses']);

-- The employee claims two expenses in one transaction.
BEGIN;
SELECT broker.begin_dialog('//hr/employee', '//finance/accounts', 'expenses') AS handle \gset
SELECT broker.send(:'handle', 'expense.claim', convert_to('{"amount": 12.50}', 'UTF8')) AS first_number;
SELECT broker.send(:'handle', 'expense.claim', convert_to('{"amount": 99.00}', 'UTF8')) AS second_number;
COMMIT;

-- Accounts receives both, in order, approves and ends the conversation.
BEGIN;
CREATE TEMP TABLE claims AS SELECT * FROM broker.receive('accounts_queue', 10);
SELECT message_sequence_number, message_type, convert_from(body, 'UTF8') AS body FROM claims;
SELECT conversation_handle AS accounts_handle FROM claims LIMIT 1 \gset
SELECT broker.send(:'accounts_handle', 'expense.approved');
SELECT broker.end_conversation(:'accounts_handle');
COMMIT;

-- The employee reads the approval and the end of the dialog, and ends too.
BEGIN;
CREATE TEMP TABLE replies AS SELECT * FROM broker.receive('employee_queue', 10);
SELECT broker.end_conversation(:'handle');
COMMIT;

DO $$
BEGIN
    ASSERT (SELECT array_agg(message_sequence_number ORDER BY message_sequence_number) FROM claims) = '{1,2}',
        'claims arrive numbered 1, 2';
    ASSERT (SELECT array_agg((convert_from(body, 'UTF8')::jsonb ->> 'amount')::numeric ORDER BY message_sequence_number)
            FROM claims) = '{12.50,99.00}', 'claims arrive with their bodies';
    ASSERT (SELECT array_agg(message_type ORDER BY message_sequence_number) FROM replies)
           = '{expense.approved,broker.end_dialog}', 'the approval, then the end of the dialog';
    ASSERT (SELECT bool_and(state = 'closed') FROM broker.conversation_endpoints), 'both endpoints closed';
    ASSERT (SELECT sum(depth) FROM broker.queue_status) = 0, 'queues empty';
END $$;

-- A mistake gets its SQLSTATE.
DO $$
BEGIN
    PERFORM broker.send(gen_random_uuid(), 'expense.claim', NULL);
    RAISE EXCEPTION 'send on an unknown conversation was accepted';
EXCEPTION WHEN SQLSTATE 'BR005' THEN
    RAISE NOTICE 'unknown conversation refused with BR005';
END $$;

\echo scenario passed
