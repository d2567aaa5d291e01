"""Logs in to a Tessera node as user "ada" (password "pencil") through psycopg (SCRAM-SHA-256
over the PostgreSQL port) and ADBC (Flight SQL's basic-auth handshake and bearer token),
and checks that a wrong password, an unknown user and no credentials are each refused with
a message that says so. Prints "ok" when every check holds.

Usage: logins.py PG_HOST PG_PORT FLIGHT_SQL_URI
"""

import sys

import adbc_driver_flightsql.dbapi as flight_sql
import psycopg

host, port, uri = sys.argv[1:4]


def pg(user, password):
    return psycopg.connect(
        f"host={host} port={port} user={user} password={password} dbname=tessera"
    )


def pg_refused(user, password, expected):
    try:
        pg(user, password).close()
    except psycopg.OperationalError as e:
        assert expected in str(e), e
        return
    raise AssertionError(f"psycopg logged in as {user} with password {password!r}")


with pg("ada", "pencil") as conn:
    # A prepared statement with a binary parameter, once logged in.
    cur = conn.cursor(binary=True)
    cur.execute("SELECT %b + 1", (41,), prepare=True)
    assert cur.fetchone() == (42,)
pg_refused("ada", "wrong", 'password authentication failed for user "ada"')
pg_refused("bob", "pencil", 'password authentication failed for user "bob"')


def flight(**credentials):
    return flight_sql.connect(uri, db_kwargs=credentials)


with flight(username="ada", password="pencil") as conn:
    cur = conn.cursor()
    cur.execute("SELECT 42 AS answer")
    assert cur.fetchone() == (42,)


def flight_refused(expected, **credentials):
    try:
        with flight(**credentials) as conn:
            cur = conn.cursor()
            cur.execute("SELECT 1")
            cur.fetchall()
    except flight_sql.Error as e:
        assert expected in str(e), e
        return
    raise AssertionError(f"Flight SQL answered with credentials {credentials}")


flight_refused('password authentication failed for user "ada"', username="ada", password="nope")
flight_refused('password authentication failed for user "bob"', username="bob", password="pencil")
flight_refused("log in first")
print("ok")
