"""A database's schema broker as plain data, from pg_catalog alone, to compare two databases."""
import difflib

import psycopg2

# Each query returns rows of text; a section is the sorted list of its rows.
QUERIES = {
    "schemas": """
        SELECT n.nspname, pg_get_userbyid(n.nspowner), obj_description(n.oid, 'pg_namespace')
        FROM pg_namespace n WHERE n.nspname = 'broker'""",
    "relations": """
        SELECT c.oid::regclass::text, c.relkind::text, c.relpersistence::text, pg_get_userbyid(c.relowner),
               array_to_string(c.reloptions, ', '), obj_description(c.oid, 'pg_class')
        FROM pg_class c
        WHERE (c.relnamespace = to_regnamespace('broker') OR c.oid = to_regclass('public.broker_alembic_version'))
          AND c.relkind NOT IN ('i', 'I')""",
    "columns": """
        SELECT a.attrelid::regclass::text,
               row_number() OVER (PARTITION BY a.attrelid ORDER BY a.attnum)::text, a.attname,
               format_type(a.atttypid, a.atttypmod), a.attnotnull::text, pg_get_expr(d.adbin, d.adrelid),
               a.attidentity::text, a.attgenerated::text, col_description(a.attrelid, a.attnum)
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE (c.relnamespace = to_regnamespace('broker') OR c.oid = to_regclass('public.broker_alembic_version'))
          AND c.relkind NOT IN ('i', 'I') AND a.attnum > 0 AND NOT a.attisdropped""",
    "constraints": """
        SELECT coalesce(con.conrelid::regclass::text, con.contypid::regtype::text), con.conname,
               pg_get_constraintdef(con.oid)
        FROM pg_constraint con
        WHERE con.connamespace = to_regnamespace('broker')
           OR con.conrelid = to_regclass('public.broker_alembic_version')""",
    "indexes": """
        SELECT schemaname, tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'broker' OR (schemaname = 'public' AND tablename = 'broker_alembic_version')""",
    "views": """
        SELECT c.oid::regclass::text, pg_get_viewdef(c.oid)
        FROM pg_class c WHERE c.relnamespace = to_regnamespace('broker') AND c.relkind IN ('v', 'm')""",
    "types": """
        SELECT t.oid::regtype::text, t.typtype::text, pg_get_userbyid(t.typowner), obj_description(t.oid, 'pg_type')
        FROM pg_type t
        LEFT JOIN pg_class c ON c.oid = t.typrelid
        WHERE t.typnamespace = to_regnamespace('broker')
          AND (c.relkind IS NULL OR c.relkind = 'c') AND t.typcategory <> 'A'""",
    "sequences": """
        SELECT s.schemaname || '.' || s.sequencename, s.data_type::text, s.start_value::text,
               s.min_value::text, s.max_value::text, s.increment_by::text, s.cycle::text, s.cache_size::text,
               s.last_value::text,
               (SELECT d.refobjid::regclass::text || '.' || a.attname FROM pg_depend d
                JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
                WHERE d.objid = (s.schemaname || '.' || s.sequencename)::regclass AND d.deptype = 'a')
        FROM pg_sequences s WHERE s.schemaname = 'broker'""",
    "functions": """
        SELECT p.oid::regprocedure::text, pg_get_userbyid(p.proowner), obj_description(p.oid, 'pg_proc'),
               pg_get_functiondef(p.oid)
        FROM pg_proc p WHERE p.pronamespace = to_regnamespace('broker')""",
    "triggers": """
        SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled::text
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = to_regnamespace('broker') AND NOT t.tgisinternal""",
    # Privileges as (object, grantee, privilege, grantable), a NULL acl read as the default it stands for.
    "privileges": """
        SELECT 'schema broker', coalesce(pg_get_userbyid(nullif(acl.grantee, 0)), 'PUBLIC'), acl.privilege_type,
               acl.is_grantable::text
        FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) acl
        WHERE n.nspname = 'broker'
        UNION ALL
        SELECT c.oid::regclass::text, coalesce(pg_get_userbyid(nullif(acl.grantee, 0)), 'PUBLIC'), acl.privilege_type,
               acl.is_grantable::text
        FROM pg_class c,
             aclexplode(coalesce(c.relacl, acldefault(CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::"char", c.relowner))) acl
        WHERE (c.relnamespace = to_regnamespace('broker') OR c.oid = to_regclass('public.broker_alembic_version'))
          AND c.relkind NOT IN ('i', 'I', 'c')
        UNION ALL
        SELECT 'default for ' || d.defaclobjtype::text || ' of ' || pg_get_userbyid(d.defaclrole),
               coalesce(pg_get_userbyid(nullif(acl.grantee, 0)), 'PUBLIC'), acl.privilege_type, acl.is_grantable::text
        FROM pg_default_acl d, aclexplode(d.defaclacl) acl
        WHERE d.defaclnamespace = to_regnamespace('broker')""",
    "function privileges": """
        SELECT p.oid::regprocedure::text, coalesce(pg_get_userbyid(nullif(acl.grantee, 0)), 'PUBLIC'),
               acl.privilege_type, acl.is_grantable::text
        FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) acl
        WHERE p.pronamespace = to_regnamespace('broker')""",
    # What the definition inserts itself; broker_instance is each node's own.
    "rows": """
        SELECT 'node', (to_jsonb(n) - 'broker_instance')::text FROM broker.node n
        UNION ALL
        SELECT 'message type', to_jsonb(t)::text FROM broker.message_types t
        UNION ALL
        SELECT 'alembic version', version_num FROM public.broker_alembic_version""",
}


def _rows(cursor, section: str) -> list[str]:
    if section == "rows":
        cursor.execute("SELECT to_regclass('broker.node') IS NOT NULL AND"
                       " to_regclass('public.broker_alembic_version') IS NOT NULL")
        if not cursor.fetchone()[0]:
            return []
    cursor.execute(QUERIES[section])
    return sorted(" | ".join("∅" if value is None else value for value in row) for row in cursor.fetchall())


# What broker/sql/functions/ defines: applied at the head, never by a revision.
FUNCTION_SECTIONS = ("functions", "function privileges", "triggers")


def snapshot(database_url: str) -> dict[str, list[str]]:
    """Every section of QUERIES for one database."""
    connection = psycopg2.connect(database_url)
    try:
        with connection.cursor() as cursor:
            return {section: _rows(cursor, section) for section in QUERIES}
    finally:
        connection.close()


def without_functions(snapshot: dict[str, list[str]]) -> dict[str, list[str]]:
    """What the revisions define: the snapshot less FUNCTION_SECTIONS."""
    return {section: rows for section, rows in snapshot.items() if section not in FUNCTION_SECTIONS}


def diff(expected: dict[str, list[str]], actual: dict[str, list[str]], names=("expected", "actual")) -> str:
    """A unified diff of two snapshots, section by section; empty when they are equal."""
    lines = []
    for section in expected:
        if expected[section] != actual[section]:
            lines.append(f"== {section}")
            lines.extend(difflib.unified_diff(
                [line for row in expected[section] for line in row.splitlines()],
                [line for row in actual[section] for line in row.splitlines()],
                fromfile=names[0], tofile=names[1], lineterm="", n=2))
    return "\n".join(lines)
