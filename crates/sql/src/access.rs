//! Who may do what, in SQL: `CREATE PARTICIPANT lab_a`, `DROP PARTICIPANT lab_a`,
//! `GRANT writer TO ada`, `REVOKE writer FROM ada`, `ALTER TABLE t OWNER TO lab_b` (the
//! hand-over of a table's ownership) and `ALTER PARTICIPANT lab_a ADD KEY '<hex>'` (a
//! public key the participant signs its epochs with). Users join a participant with `CREATE USER ... IN
//! PARTICIPANT p` (`crate::users`). The rules themselves live with the cluster's metadata;
//! this module only reads the statements.

use crate::error::Result;
use crate::statements::{syntax, Tokens};
use datafusion::sql::sqlparser::keywords::Keyword;

/// A parsed access statement.
#[derive(Debug, Clone, PartialEq)]
pub enum AccessStatement {
    CreateParticipant {
        name: String,
        tolerant: bool,
    },
    DropParticipant {
        name: String,
        tolerant: bool,
    },
    /// `role` as written (`reader`, `writer`, `admin`); the cluster checks it.
    Grant {
        role: String,
        user: String,
    },
    Revoke {
        role: String,
        user: String,
    },
    SetOwner {
        table: String,
        owner: String,
    },
    /// An ed25519 public key, hex; the cluster checks it.
    AddKey {
        participant: String,
        key: String,
    },
}

impl AccessStatement {
    /// The command tag PostgreSQL answers with.
    pub fn command_tag(&self) -> &'static str {
        match self {
            AccessStatement::CreateParticipant { .. } => "CREATE PARTICIPANT",
            AccessStatement::DropParticipant { .. } => "DROP PARTICIPANT",
            AccessStatement::Grant { .. } => "GRANT ROLE",
            AccessStatement::Revoke { .. } => "REVOKE ROLE",
            AccessStatement::SetOwner { .. } => "ALTER TABLE",
            AccessStatement::AddKey { .. } => "ALTER PARTICIPANT",
        }
    }
}

impl std::fmt::Display for AccessStatement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AccessStatement::CreateParticipant { name, .. } => {
                write!(f, "CREATE PARTICIPANT {name}")
            }
            AccessStatement::DropParticipant { name, .. } => write!(f, "DROP PARTICIPANT {name}"),
            AccessStatement::Grant { role, user } => write!(f, "GRANT {role} TO {user}"),
            AccessStatement::Revoke { role, user } => write!(f, "REVOKE {role} FROM {user}"),
            AccessStatement::SetOwner { table, owner } => {
                write!(f, "ALTER TABLE {table} OWNER TO {owner}")
            }
            AccessStatement::AddKey { participant, key } => {
                write!(f, "ALTER PARTICIPANT {participant} ADD KEY '{key}'")
            }
        }
    }
}

/// `Some` if `sql` is an access statement, parsed or with the error that names what is
/// wrong; `None` for any other SQL (other `GRANT`s and `ALTER TABLE` forms included).
pub fn parse_access_statement(sql: &str) -> Option<Result<AccessStatement>> {
    let mut tokens = Tokens::of(sql)?;
    let statement = match tokens.keyword_of(&[
        Keyword::CREATE,
        Keyword::DROP,
        Keyword::GRANT,
        Keyword::REVOKE,
        Keyword::ALTER,
    ])? {
        verb @ (Keyword::CREATE | Keyword::DROP) => {
            if !tokens.word("participant") {
                return None;
            }
            tokens.participant_statement(verb == Keyword::CREATE)
        }
        verb @ (Keyword::GRANT | Keyword::REVOKE) => tokens.role_statement(verb == Keyword::GRANT),
        _ if tokens.word("participant") => tokens.key_statement(),
        _ => {
            tokens.keyword_of(&[Keyword::TABLE])?;
            let table = tokens.name("a table name").ok()?;
            if !tokens.keywords(&[Keyword::OWNER, Keyword::TO]) {
                return None;
            }
            tokens.owner_statement(table)
        }
    };
    Some(statement)
}

impl Tokens {
    fn participant_statement(&mut self, create: bool) -> Result<AccessStatement> {
        let statement = if create {
            let tolerant = self.keywords(&[Keyword::IF, Keyword::NOT, Keyword::EXISTS]);
            let name = self.name("a participant name")?;
            AccessStatement::CreateParticipant { name, tolerant }
        } else {
            let tolerant = self.keywords(&[Keyword::IF, Keyword::EXISTS]);
            let name = self.name("a participant name")?;
            AccessStatement::DropParticipant { name, tolerant }
        };
        self.end("participant")?;
        Ok(statement)
    }

    /// `GRANT role TO user` / `REVOKE role FROM user`.
    fn role_statement(&mut self, grant: bool) -> Result<AccessStatement> {
        let role = self.name("a role (reader, writer or admin)")?;
        let (preposition, verb) = match grant {
            true => (Keyword::TO, "GRANT"),
            false => (Keyword::FROM, "REVOKE"),
        };
        if self.keyword_of(&[preposition]).is_none() {
            return Err(syntax(format!(
                "{verb} grants roles to users: {verb} {{reader | writer | admin}} {} user (privileges on single tables follow from the table's owner)",
                if grant { "TO" } else { "FROM" }
            )));
        }
        let user = self.name("a user name")?;
        self.end(verb)?;
        Ok(match grant {
            true => AccessStatement::Grant { role, user },
            false => AccessStatement::Revoke { role, user },
        })
    }

    /// `ALTER PARTICIPANT p ADD KEY '<hex>'`.
    fn key_statement(&mut self) -> Result<AccessStatement> {
        let participant = self.name("a participant name")?;
        if !(self.keyword_of(&[Keyword::ADD]).is_some()
            && self.keyword_of(&[Keyword::KEY]).is_some())
        {
            return Err(syntax(format!(
                "ALTER PARTICIPANT registers a signing key: ALTER PARTICIPANT {participant} ADD KEY '<public key, hex>'"
            )));
        }
        let key = self.string("the public key")?;
        self.end("ALTER PARTICIPANT")?;
        Ok(AccessStatement::AddKey { participant, key })
    }

    fn owner_statement(&mut self, table: String) -> Result<AccessStatement> {
        let owner = self.name("a participant name")?;
        self.end("ALTER TABLE ... OWNER TO")?;
        Ok(AccessStatement::SetOwner { table, owner })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(sql: &str) -> AccessStatement {
        parse_access_statement(sql)
            .expect("an access statement")
            .unwrap()
    }

    #[test]
    fn access_statements_parse() {
        assert_eq!(
            parsed("CREATE PARTICIPANT Lab_A;"),
            AccessStatement::CreateParticipant {
                name: "lab_a".into(),
                tolerant: false
            }
        );
        assert_eq!(
            parsed("drop participant if exists \"Lab B\""),
            AccessStatement::DropParticipant {
                name: "Lab B".into(),
                tolerant: true
            }
        );
        assert_eq!(
            parsed("GRANT writer TO ada"),
            AccessStatement::Grant {
                role: "writer".into(),
                user: "ada".into()
            }
        );
        assert_eq!(
            parsed("REVOKE admin FROM ada"),
            AccessStatement::Revoke {
                role: "admin".into(),
                user: "ada".into()
            }
        );
        assert_eq!(
            parsed("ALTER TABLE t OWNER TO lab_b"),
            AccessStatement::SetOwner {
                table: "t".into(),
                owner: "lab_b".into()
            }
        );
        assert_eq!(
            parsed("ALTER PARTICIPANT lab_a ADD KEY 'ab12'"),
            AccessStatement::AddKey {
                participant: "lab_a".into(),
                key: "ab12".into()
            }
        );
    }

    #[test]
    fn other_statements_are_not_access_statements() {
        for sql in [
            "CREATE TABLE participant (a INT)",
            "ALTER TABLE t ADD COLUMN c INT",
            "ALTER TABLE t SET (retain_epochs = 3)",
            "SELECT 1",
        ] {
            assert!(parse_access_statement(sql).is_none(), "{sql}");
        }
    }

    #[test]
    fn malformed_access_statements_name_what_is_wrong() {
        let error = parse_access_statement("GRANT SELECT ON t TO ada")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(error.contains("GRANT grants roles to users"), "{error}");
        let error = parse_access_statement("CREATE PARTICIPANT a b")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(error.contains("unexpected 'b'"), "{error}");
        let error = parse_access_statement("ALTER TABLE t OWNER TO")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(error.contains("expected a participant name"), "{error}");
        let error = parse_access_statement("ALTER PARTICIPANT lab_a ADD KEY abc")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("the public key as a quoted string"),
            "{error}"
        );
        let error = parse_access_statement("ALTER PARTICIPANT lab_a RENAME TO b")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(error.contains("ADD KEY"), "{error}");
    }
}
