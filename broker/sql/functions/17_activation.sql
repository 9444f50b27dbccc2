-- Internal activation, as in Service Broker's ALTER QUEUE ... WITH ACTIVATION:
-- a queue names a procedure, and every running node (broker serve) calls it,
-- each call in a transaction of its own, while the queue has messages that no
-- reader holds.  The procedure receives them itself, with broker.receive, in
-- that transaction, and does its work there: the node commits when it
-- returns, and rolls back when it raises.  A rollback is counted against the
-- message it left, as any reader's rollback is (broker.count_unreported_rollbacks),
-- so a message that keeps failing ends in the dead letters.
--
-- The procedure runs as execute_as (by default its owner): the node sets that
-- role for the transaction.  It must not be a superuser, and it must be able
-- to execute the procedure and broker.receive (GRANT broker_application TO it).
--
-- A node's reader holds, for as long as it runs, the session advisory lock
-- (1633907817, queue_id * 100 + slot) of a slot below max_queue_readers: the
-- readers of all nodes on the database together stay within it, and
-- broker.activation_status counts them.

-- The procedure as activation calls it: a PROCEDURE taking the queue's name
-- (text), by its name, schema-qualified or not.  BR080 otherwise.
CREATE OR REPLACE FUNCTION broker._activation_procedure(procedure_name text) RETURNS regprocedure
LANGUAGE plpgsql STABLE AS $$
DECLARE
    found regprocedure;
BEGIN
    BEGIN
        found := to_regprocedure(broker._require('procedure_name', procedure_name) || '(text)');
    EXCEPTION WHEN syntax_error OR invalid_name OR undefined_object THEN
        found := NULL;  -- not a name
    END;
    IF found IS NULL OR (SELECT p.prokind FROM pg_proc p WHERE p.oid = found) <> 'p' THEN
        PERFORM broker._raise('BR080', format('no procedure %s(queue text)', left(procedure_name, 140)),
            'create it with CREATE PROCEDURE name(queue text) LANGUAGE plpgsql AS ... (it calls broker.receive(queue) itself)');
    END IF;
    RETURN found;
END $$;

-- BR081 unless role_name may run the procedure: a role that exists, is not a
-- superuser, and may execute the procedure and broker.receive.
CREATE OR REPLACE FUNCTION broker._check_activation_role(role_name text, procedure_oid regprocedure) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r pg_roles;
BEGIN
    SELECT * INTO r FROM pg_roles WHERE rolname = role_name;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR081', format('unknown role %L', role_name));
    END IF;
    IF r.rolsuper THEN
        PERFORM broker._raise('BR081', format('activation does not run as a superuser, and %I is one', role_name),
            'name a role of the application with execute_as, granted broker_application and what the procedure uses');
    END IF;
    IF NOT has_function_privilege(r.oid, procedure_oid, 'EXECUTE') THEN
        PERFORM broker._raise('BR081', format('role %I may not execute %s', role_name, procedure_oid),
            format('GRANT EXECUTE ON PROCEDURE %s TO %I', procedure_oid, role_name));
    END IF;
    IF NOT has_function_privilege(r.oid, 'broker.receive(text,integer,uuid,integer,uuid)', 'EXECUTE') THEN
        PERFORM broker._raise('BR081', format('role %I may not execute broker.receive', role_name),
            format('GRANT broker_application TO %I', role_name));
    END IF;
END $$;

-- NULL arguments leave a setting as it is; a queue's first activation needs a
-- procedure, and runs it with one reader, as the procedure's owner, unless
-- told otherwise.
CREATE OR REPLACE FUNCTION broker.set_queue_activation(queue text, procedure_name text DEFAULT NULL,
                                                       max_queue_readers integer DEFAULT NULL,
                                                       status boolean DEFAULT NULL, execute_as text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues := broker._queue(queue);
    current broker.queue_activation;
    procedure_oid regprocedure;
BEGIN
    SELECT * INTO current FROM broker.queue_activation a WHERE a.queue_id = q.queue_id FOR UPDATE;
    IF procedure_name IS NULL AND current.procedure_name IS NULL THEN
        PERFORM broker._raise('BR050', format('queue %L has no activation yet: give procedure_name', queue));
    END IF;
    procedure_oid := broker._activation_procedure(coalesce(procedure_name, current.procedure_name));
    max_queue_readers := coalesce(max_queue_readers, current.max_queue_readers, 1);
    IF max_queue_readers NOT BETWEEN 1 AND 100 THEN
        PERFORM broker._raise('BR050', format('max_queue_readers must be 1 to 100, got %s', max_queue_readers));
    END IF;
    execute_as := coalesce(execute_as, current.execute_as,
                           (SELECT pg_get_userbyid(p.proowner) FROM pg_proc p WHERE p.oid = procedure_oid));
    PERFORM broker._check_activation_role(execute_as, procedure_oid);
    INSERT INTO broker.queue_activation AS a (queue_id, procedure_name, max_queue_readers, is_enabled, execute_as)
    SELECT q.queue_id, format('%I.%I', n.nspname, p.proname), max_queue_readers,
           coalesce(status, current.is_enabled, true), execute_as
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE p.oid = procedure_oid
    ON CONFLICT (queue_id) DO UPDATE
    SET procedure_name = excluded.procedure_name, max_queue_readers = excluded.max_queue_readers,
        is_enabled = excluded.is_enabled, execute_as = excluded.execute_as;
END $$;
COMMENT ON FUNCTION broker.set_queue_activation(text, text, integer, boolean, text) IS $$(admin) Service Broker's
`ALTER QUEUE … WITH ACTIVATION`: every running node calls `procedure_name(queue text)` while the queue has messages,
each call in a transaction of its own (committed when it returns, rolled back and counted toward `poison_threshold`
when it raises), up to `max_queue_readers` (1–100, default 1) at once for all nodes, `status` on or off, as
`execute_as` (default: the procedure's owner; never a superuser). NULL leaves a setting as it is. BR080 when there is
no such procedure taking one text argument, BR081 when the role is unknown, a superuser, or may not execute the
procedure or `broker.receive`, BR050 for `max_queue_readers` out of range or no procedure on a first declaration.$$;

CREATE OR REPLACE FUNCTION broker.drop_queue_activation(queue text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM broker.queue_activation WHERE queue_id = (broker._queue(queue)).queue_id;
    IF NOT FOUND THEN
        PERFORM broker._raise('BR004', format('queue %L has no activation', queue));
    END IF;
END $$;
COMMENT ON FUNCTION broker.drop_queue_activation(text) IS $$(admin) Ends a queue's activation; BR004 when it has
none.$$;

-- The queues whose activation is on (and which are enabled), with whether any
-- message waits in them: what a node's supervisor looks at.  The queue's id is
-- what the notification of an arrival names (broker_queue).
CREATE OR REPLACE FUNCTION broker.activated_queues()
RETURNS TABLE (queue_id integer, queue_name text, max_queue_readers integer, messages_waiting boolean)
LANGUAGE sql STABLE AS $$
    SELECT q.queue_id, q.name, a.max_queue_readers,
           EXISTS (SELECT 1 FROM broker.queue_messages m WHERE m.queue_id = q.queue_id AND m.received_at IS NULL)
    FROM broker.queue_activation a
    JOIN broker.queues q USING (queue_id)
    WHERE a.is_enabled AND q.is_enabled
    ORDER BY q.name
$$;
COMMENT ON FUNCTION broker.activated_queues() IS $$(node) The queues whose activation is on (and which are enabled),
with their `max_queue_readers` and whether messages wait: what a node's activation looks at.$$;

-- Takes a free reader slot of the queue's activation for this session (held
-- until the session ends) and returns it; NULL when all max_queue_readers
-- slots are taken, or the queue has no activation.
CREATE OR REPLACE FUNCTION broker.take_activation_slot(queue text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    a broker.queue_activation;
BEGIN
    SELECT a0.* INTO a FROM broker.queue_activation a0 JOIN broker.queues q USING (queue_id) WHERE q.name = queue;
    FOR slot IN 0 .. coalesce(a.max_queue_readers, 0) - 1 LOOP
        IF pg_try_advisory_lock(1633907817, a.queue_id * 100 + slot) THEN
            RETURN slot;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION broker.take_activation_slot(text) IS $$(node) Takes a reader slot of the queue's activation for
the session (a session advisory lock, held until the session ends) and returns it; NULL when all `max_queue_readers`
are taken, or the queue has no activation.$$;

-- Calls the queue's procedure once, in the caller's transaction, as its
-- execute_as, when a conversation group of the queue has messages no other
-- transaction holds (it is locked first, so the procedure's broker.receive
-- finds it).  Returns NULL, without calling, when there is none, when
-- activation is off or the queue disabled, or when the reader's slot is no
-- longer below max_queue_readers: the reader then stops.  Else it returns ''
-- when the procedure returned, and after that the transaction runs as
-- execute_as: the caller commits or rolls back next, and does nothing else in
-- it.  When the procedure raises, what it did is rolled back (it runs in a
-- subtransaction), the failure is counted against the head message of the
-- group, which is backed off (broker._count_failure), and the error's message
-- is returned: the caller commits the count.  An error that ends the whole
-- transaction (the statement's timeout, say) is counted by the node later
-- (broker.count_unreported_rollbacks).
CREATE OR REPLACE FUNCTION broker.call_activated_procedure(queue text, slot integer) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    q broker.queues;
    a broker.queue_activation;
    locked_group uuid;
    failure text;
BEGIN
    SELECT * INTO q FROM broker.queues WHERE name = queue;
    SELECT * INTO a FROM broker.queue_activation WHERE queue_id = q.queue_id;
    IF NOT FOUND OR NOT a.is_enabled OR NOT q.is_enabled OR slot >= a.max_queue_readers THEN
        RETURN NULL;
    END IF;
    locked_group := broker._wait_for_group(q, NULL, NULL, 0);
    IF locked_group IS NULL THEN
        RETURN NULL;
    END IF;
    BEGIN
        PERFORM set_config('role', a.execute_as, true);
        EXECUTE format('CALL %s($1)', a.procedure_name) USING queue;
        RETURN '';
    EXCEPTION WHEN OTHERS THEN  -- the role is the node's again, as before the subtransaction
        failure := SQLERRM;
    END;
    PERFORM broker.report_processing_failure(queue, locked_group, failure);
    RETURN failure;
END $$;
COMMENT ON FUNCTION broker.call_activated_procedure(text, integer) IS $$(node) One call of the queue's procedure in
the caller's transaction, as `execute_as`, after locking a group with messages no other transaction holds: `''` when
it returned; when it raised, what it did is rolled back (a subtransaction), the failure is counted as
`report_processing_failure` counts one, and the error's message is returned. NULL, calling nothing, when there is no
such group, when activation is off or the queue disabled, or the slot is past `max_queue_readers`.$$;

-- One call, as the node of the release before revision 0035 makes it: whether
-- it called.  A failure is counted already.
CREATE OR REPLACE FUNCTION broker.activate(queue text, slot integer) RETURNS boolean
LANGUAGE sql AS $$
    SELECT broker.call_activated_procedure(queue, slot) IS NOT NULL;
$$;
COMMENT ON FUNCTION broker.activate(text, integer) IS $$(node) Whether `call_activated_procedure` called: kept for
nodes of the release before revision 0035.$$;
