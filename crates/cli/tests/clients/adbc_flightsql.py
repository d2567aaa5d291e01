"""Drives a Tessera node's Flight SQL port through ADBC (adbc_driver_flightsql), as a
Python data team would.

Usage: adbc_flightsql.py URI QUERIES_DIR OUT_DIR
- runs each QUERIES_DIR/qN.sql (ADBC prepares every query) and writes the Arrow result to
  OUT_DIR/qN.arrow for the Rust test to compare with plain DataFusion;
- checks the catalog listing, bulk ingest, an INSERT's row count, bound parameters (one
  row per query, several per INSERT), a transaction committed and one rolled back, and a
  clear error for a missing table or value; prints "ok" when all hold. (ADBC itself sends no message over 16 MiB, the
  server's SQL limit, so an oversized query never reaches the server from it.)
"""

import os
import sys

import adbc_driver_flightsql.dbapi as flight_sql
import pyarrow as pa
import pyarrow.ipc as ipc


def main():
    uri, queries_dir, out_dir = sys.argv[1:4]
    with flight_sql.connect(uri, autocommit=True) as conn:
        cur = conn.cursor()
        for name in sorted(os.listdir(queries_dir)):
            with open(os.path.join(queries_dir, name)) as f:
                sql = f.read()
            cur.execute(sql)
            table = cur.fetch_arrow_table()
            with ipc.new_file(os.path.join(out_dir, name.replace(".sql", ".arrow")), table.schema) as w:
                w.write_table(table)

        objects = conn.adbc_get_objects(depth="tables").read_all().to_pylist()
        tables = {t["table_name"] for c in objects for s in c["catalog_db_schemas"] for t in s["db_schema_tables"]}
        assert "lineitem" in tables, tables

        cur.execute("CREATE TABLE ingested (id BIGINT PRIMARY KEY, name VARCHAR)")
        data = pa.table({"id": pa.array(range(1000), pa.int64()), "name": [f"n{i}" for i in range(1000)]})
        rows = cur.adbc_ingest("ingested", data, mode="append")
        assert rows in (1000, -1), rows
        cur.execute("SELECT count(*) AS n, max(id) AS m FROM ingested")
        assert cur.fetchone() == (1000, 999)

        cur.execute("INSERT INTO ingested VALUES (5000, 'x'), (5001, 'y')")
        assert cur.rowcount in (2, -1), cur.rowcount

        cur.execute("SELECT count(*) FROM ingested")
        assert cur.fetchone() == (1002,)

        # Parameters, as ? or $n, bound per execution (ADBC binds them through DoPut).
        cur.execute("SELECT name FROM ingested WHERE id = ?", (7,))
        assert cur.fetchall() == [("n7",)]
        cur.execute("SELECT count(*) FROM ingested WHERE id >= $1 AND id < 1000 AND name <> $2", (990, "n995"))
        assert cur.fetchone() == (9,)
        # Several rows of values: one transaction, so one epoch.
        cur.executemany("INSERT INTO ingested VALUES (?, ?)", [(6000, "a"), (6001, "b"), (6002, "c")])
        cur.execute("SELECT count(*), min(name) FROM ingested WHERE id >= ?", (6000,))
        assert cur.fetchone() == (3, "a")
        # A transaction (DB-API's default, autocommit off): its reads see its own writes;
        # they are not seen outside it before the commit, which publishes them as one
        # epoch; a rollback leaves nothing.
        with flight_sql.connect(uri) as tx:
            c = tx.cursor()
            c.execute("INSERT INTO ingested VALUES (7000, 'p')")
            c.execute("INSERT INTO ingested VALUES (?, ?)", (7001, "q"))
            c.execute("UPDATE ingested SET name = 'p2' WHERE id = 7000")
            c.execute("SELECT id, name FROM ingested WHERE id >= 7000 ORDER BY id")
            assert c.fetchall() == [(7000, "p2"), (7001, "q")], "its own writes"
            cur.execute("SELECT count(*) FROM ingested WHERE id >= 7000")
            assert cur.fetchone() == (0,), "and not outside it before the commit"
            tx.commit()
            c.execute("INSERT INTO ingested VALUES (7002, 'r')")
            tx.rollback()
        cur.execute("SELECT count(*) FROM ingested WHERE id >= 7000")
        assert cur.fetchone() == (2,), "the committed rows, not the rolled back one"
        cur.execute("SELECT name FROM ingested WHERE id = 7000")
        assert cur.fetchone() == ("p2",), "the update inside the transaction committed"

        try:
            cur.execute("SELECT * FROM ingested WHERE id = ? AND name = ?", (1,))
            cur.fetchall()
            raise AssertionError("a missing parameter value was not an error")
        except flight_sql.Error as e:
            assert "2 parameter(s)" in str(e) and "1 value(s)" in str(e), e
        try:
            cur.execute("SELECT * FROM nosuch")
            cur.fetch_arrow_table()
            raise AssertionError("a missing table was not an error")
        except flight_sql.Error as e:
            assert "nosuch" in str(e) and "not found" in str(e), e
    print("ok")


if __name__ == "__main__":
    main()
