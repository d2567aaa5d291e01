"""psycopg 3 against one Tessera node, as a notebook would use it: default (non-autocommit)
transactions, server-side prepared statements with binary parameters and results, a
rollback, and errors as psycopg's typed exceptions. Prints "ok" when every check holds."""

import sys

import psycopg
from psycopg import errors

host, port = sys.argv[1], sys.argv[2]
with psycopg.connect(f"host={host} port={port} user=tessera dbname=tessera") as conn:
    # psycopg opens a transaction before the first statement; DDL before any write runs.
    conn.execute("CREATE TABLE py_kv (k BIGINT NOT NULL, v VARCHAR, PRIMARY KEY (k))")
    conn.commit()
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO py_kv (k, v) VALUES (%s, %s)", [(i, f"v{i}") for i in range(10)]
        )
    conn.commit()

    cur = conn.cursor(binary=True)
    for _ in range(3):  # prepare=True: Parse once, then Bind/Execute with binary values
        cur.execute("SELECT v FROM py_kv WHERE k = %b", (7,), prepare=True)
        assert cur.fetchone()[0] == "v7"
        cur.execute("SELECT count(*) FROM py_kv WHERE k < %b", (5,), prepare=True)
        assert cur.fetchone()[0] == 5
    conn.commit()

    conn.execute("INSERT INTO py_kv VALUES (100, 'rolled back')")
    conn.rollback()
    assert conn.execute("SELECT count(*) FROM py_kv").fetchone()[0] == 10
    conn.commit()

    try:
        conn.execute("SELECT * FROM nosuch")
        raise AssertionError("an unknown table must fail")
    except errors.UndefinedTable:
        conn.rollback()
    try:
        conn.execute("INSERT INTO py_kv VALUES (1, 'again')")
        raise AssertionError("a duplicate key must fail")
    except errors.UniqueViolation:
        conn.rollback()
print("ok")
