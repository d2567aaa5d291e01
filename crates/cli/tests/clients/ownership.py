"""A user of a participant that does not own table "readings" tries to publish to it through
psycopg and ADBC (Flight SQL): each INSERT is refused with SQLSTATE 42501 (insufficient
privilege) and a message naming the owner, and the same user's reads go through. Prints
"ok" when every check holds.

Usage: ownership.py PG_HOST PG_PORT FLIGHT_SQL_URI USER PASSWORD
"""

import sys

import adbc_driver_flightsql.dbapi as flight_sql
import psycopg

host, port, uri, user, password = sys.argv[1:6]

with psycopg.connect(
    f"host={host} port={port} user={user} password={password} dbname=tessera",
    autocommit=True,
) as conn:
    cur = conn.cursor()
    refused = None
    try:
        cur.execute("INSERT INTO readings VALUES (%s, %s)", (9001, 1))
    except psycopg.errors.InsufficientPrivilege as e:
        refused = e
    assert refused is not None, "psycopg's INSERT by a non-owner was accepted"
    assert "participant lab_a owns it" in str(refused), refused
    cur.execute("SELECT count(*) FROM readings")
    (rows,) = cur.fetchone()
    assert rows >= 1, rows

with flight_sql.connect(uri, db_kwargs={"username": user, "password": password}) as conn:
    # DB-API's default: a transaction, which the driver opens with BeginTransaction. The
    # write is refused at the statement, not at a later commit.
    cur = conn.cursor()
    refused = None
    try:
        cur.execute("INSERT INTO readings VALUES (9002, 1)")
    except Exception as e:  # ADBC raises its own error classes per driver
        refused = e
    assert refused is not None, "Flight SQL's INSERT by a non-owner was accepted"
    assert "permission denied" in str(refused), refused
    assert "participant lab_a owns it" in str(refused), refused
    conn.rollback()
    cur.execute("SELECT count(*) FROM readings")
    assert cur.fetchone()[0] >= 1

print("ok")
