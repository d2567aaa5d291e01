// Drives a Tessera node's PostgreSQL port through pgJDBC, as a BI tool (DBeaver) or a JVM
// service would: the driver's start-up, DatabaseMetaData listings, prepared statements with
// typed parameters, a transaction across two tables, and SQLSTATEs.
//
// Usage: java -cp postgresql.jar JdbcSmoke.java HOST PORT   (prints "ok" when all hold)

import java.sql.*;
import java.util.*;

public class JdbcSmoke {
    static void check(boolean holds, String what) {
        if (!holds) throw new AssertionError(what);
    }

    public static void main(String[] args) throws Exception {
        String url = "jdbc:postgresql://" + args[0] + ":" + args[1] + "/tessera";
        Properties props = new Properties();
        props.setProperty("user", "tessera");
        try (Connection conn = DriverManager.getConnection(url, props)) {
            DatabaseMetaData meta = conn.getMetaData();
            check(meta.getDatabaseProductName().equals("PostgreSQL"), meta.getDatabaseProductName());

            try (Statement st = conn.createStatement()) {
                st.execute("CREATE TABLE jdbc_a (id BIGINT PRIMARY KEY, name VARCHAR)");
                st.execute("CREATE TABLE jdbc_b (id BIGINT PRIMARY KEY, amount DOUBLE PRECISION)");
            }

            // What DBeaver's navigator asks for.
            Set<String> tables = new HashSet<>();
            try (ResultSet rs = meta.getTables(null, null, "jdbc_%", new String[] {"TABLE"})) {
                while (rs.next()) tables.add(rs.getString("TABLE_NAME"));
            }
            check(tables.equals(Set.of("jdbc_a", "jdbc_b")), "getTables: " + tables);
            List<String> columns = new ArrayList<>();
            try (ResultSet rs = meta.getColumns(null, null, "jdbc_b", null)) {
                while (rs.next()) columns.add(rs.getString("COLUMN_NAME") + ":" + rs.getString("TYPE_NAME"));
            }
            check(columns.equals(List.of("id:int8", "amount:float8")), "getColumns: " + columns);

            // A transaction across both tables: one commit, both visible together.
            conn.setAutoCommit(false);
            try (PreparedStatement a = conn.prepareStatement("INSERT INTO jdbc_a VALUES (?, ?)");
                 PreparedStatement b = conn.prepareStatement("INSERT INTO jdbc_b VALUES (?, ?)")) {
                for (long id = 1; id <= 50; id++) {
                    a.setLong(1, id);
                    a.setString(2, "name " + id);
                    a.executeUpdate();
                    b.setLong(1, id);
                    b.setDouble(2, id * 1.5);
                    b.executeUpdate();
                }
            }
            conn.commit();
            conn.setAutoCommit(true);

            try (PreparedStatement q = conn.prepareStatement(
                    "SELECT a.name, b.amount FROM jdbc_a a JOIN jdbc_b b ON a.id = b.id WHERE a.id = ?")) {
                q.setLong(1, 7);
                try (ResultSet rs = q.executeQuery()) {
                    check(rs.next(), "no row for id 7");
                    check(rs.getString(1).equals("name 7") && rs.getDouble(2) == 10.5,
                          "row 7: " + rs.getString(1) + ", " + rs.getDouble(2));
                    check(!rs.next(), "one row for id 7");
                }
                // The same prepared statement again (pgJDBC switches to a server-side one).
                for (long id = 1; id <= 6; id++) {
                    q.setLong(1, id);
                    try (ResultSet rs = q.executeQuery()) {
                        check(rs.next() && rs.getString(1).equals("name " + id), "row " + id);
                    }
                }
            }
            try (Statement st = conn.createStatement();
                 ResultSet rs = st.executeQuery("SELECT count(*), sum(amount) FROM jdbc_b")) {
                rs.next();
                check(rs.getLong(1) == 50 && rs.getDouble(2) == 1912.5, "count and sum");
            }

            // A rolled back transaction leaves nothing.
            conn.setAutoCommit(false);
            try (Statement st = conn.createStatement()) {
                st.executeUpdate("INSERT INTO jdbc_a VALUES (1000, 'gone')");
            }
            conn.rollback();
            conn.setAutoCommit(true);

            try (Statement st = conn.createStatement()) {
                try (ResultSet rs = st.executeQuery("SELECT count(*) FROM jdbc_a")) {
                    rs.next();
                    check(rs.getLong(1) == 50, "the rolled back row is not there");
                }
                try {
                    st.executeQuery("SELECT * FROM nosuch");
                    check(false, "a missing table was not an error");
                } catch (SQLException e) {
                    check("42P01".equals(e.getSQLState()), "SQLSTATE " + e.getSQLState() + ": " + e.getMessage());
                }
                try {
                    st.executeUpdate("INSERT INTO jdbc_a VALUES (1, 'again')");
                    check(false, "a duplicate key was not an error");
                } catch (SQLException e) {
                    check("23505".equals(e.getSQLState()), "SQLSTATE " + e.getSQLState() + ": " + e.getMessage());
                }
            }
        }
        System.out.println("ok");
    }
}
