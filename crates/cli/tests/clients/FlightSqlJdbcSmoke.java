// Drives a Tessera node's Flight SQL port through the Arrow Flight SQL JDBC driver, as a
// JVM tool would: DDL and an INSERT as updates, DatabaseMetaData listings, a query, and a
// prepared query with a bound parameter.
//
// Usage: java --add-opens=java.base/java.nio=ALL-UNNAMED -cp flight-sql-jdbc-driver.jar \
//            FlightSqlJdbcSmoke.java HOST PORT   (prints "ok" when all hold)

import java.sql.*;
import java.util.*;

public class FlightSqlJdbcSmoke {
    static void check(boolean holds, String what) {
        if (!holds) throw new AssertionError(what);
    }

    public static void main(String[] args) throws Exception {
        String url = "jdbc:arrow-flight-sql://" + args[0] + ":" + args[1] + "/?useEncryption=false";
        try (Connection conn = DriverManager.getConnection(url)) {
            try (Statement st = conn.createStatement()) {
                st.executeUpdate("CREATE TABLE fjdbc (id BIGINT PRIMARY KEY, name VARCHAR)");
                int inserted = st.executeUpdate("INSERT INTO fjdbc VALUES (1, 'one'), (2, 'two'), (3, 'three')");
                check(inserted == 3, "INSERT count " + inserted);
            }
            Set<String> tables = new HashSet<>();
            try (ResultSet rs = conn.getMetaData().getTables(null, null, "%", null)) {
                while (rs.next()) tables.add(rs.getString("TABLE_NAME"));
            }
            check(tables.contains("fjdbc"), "getTables: " + tables);
            try (Statement st = conn.createStatement();
                 ResultSet rs = st.executeQuery("SELECT count(*) AS n, max(name) AS m FROM fjdbc")) {
                check(rs.next() && rs.getLong("n") == 3 && rs.getString("m").equals("two"), "count and max");
            }
            try (PreparedStatement q = conn.prepareStatement("SELECT name FROM fjdbc WHERE id = ?")) {
                for (long id = 1; id <= 3; id++) {
                    q.setLong(1, id);
                    try (ResultSet rs = q.executeQuery()) {
                        check(rs.next(), "no row for id " + id);
                        String name = rs.getString(1);
                        check(name.equals(List.of("one", "two", "three").get((int) id - 1)), "row " + id + ": " + name);
                        check(!rs.next(), "one row for id " + id);
                    }
                }
            }
            try (Statement st = conn.createStatement()) {
                st.executeQuery("SELECT * FROM nosuch");
                check(false, "a missing table was not an error");
            } catch (SQLException e) {
                check(e.getMessage().contains("nosuch"), e.getMessage());
            }
        }
        System.out.println("ok");
    }
}
