"""The rule for the names of message types, contracts, queues and services (as broker._check_name
enforces it in SQL): 1-128 letters, digits and _ . : / @ # -, starting with a letter, a digit or /."""

NAME_PATTERN = r"[A-Za-z0-9/][A-Za-z0-9_.:/@#-]{0,127}"
