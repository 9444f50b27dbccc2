-- Removes everything revision 0001 created.
DROP SCHEMA broker CASCADE;
