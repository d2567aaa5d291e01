//! `CREATE USER`, `ALTER USER` and `DROP USER` (and their `ROLE` spellings): the users who
//! may log in to the SQL endpoints. DataFusion's parser reads these statements in
//! Snowflake's form, not PostgreSQL's (`CREATE USER ada WITH PASSWORD '...'`), so they are
//! recognized here, from the tokens, before the SQL reaches it.
//!
//! A password never goes further than this module: it becomes a SCRAM secret at once, and
//! a statement is shown (activity, logs) only with its password masked. A password given
//! as a SCRAM verifier (`SCRAM-SHA-256$4096:salt$StoredKey:ServerKey`, what psql's
//! `\password` sends) is stored as it is.

use crate::error::{Result, SqlError};
use crate::statements::{describe, syntax, Tokens};
use datafusion::sql::sqlparser::keywords::Keyword;
use datafusion::sql::sqlparser::tokenizer::Token;
use tessera_common::auth::ScramSecret;

/// What a user statement asks of the cluster's metadata.
#[derive(Debug, Clone, PartialEq)]
pub enum UserChange {
    /// A user of `participant`, or with none a cluster administrator; a participant's
    /// administrator creates users of its own participant when it names none.
    Create {
        name: String,
        secret: ScramSecret,
        participant: Option<String>,
    },
    Alter {
        name: String,
        secret: ScramSecret,
    },
    Drop {
        name: String,
    },
}

/// A parsed user statement.
#[derive(Debug, Clone, PartialEq)]
pub struct UserStatement {
    pub change: UserChange,
    /// `IF NOT EXISTS` / `IF EXISTS`: an existing (missing) user is not an error.
    pub tolerant: bool,
}

impl UserStatement {
    /// The command tag PostgreSQL answers with.
    pub fn tag(&self) -> &'static str {
        match self.change {
            UserChange::Create { .. } => "CREATE ROLE",
            UserChange::Alter { .. } => "ALTER ROLE",
            UserChange::Drop { .. } => "DROP ROLE",
        }
    }

    /// The statement as it may be shown: never with its password.
    pub fn redacted(&self) -> String {
        match &self.change {
            UserChange::Create {
                name,
                participant: Some(participant),
                ..
            } => format!("CREATE USER {name} WITH PASSWORD '***' IN PARTICIPANT {participant}"),
            UserChange::Create { name, .. } => format!("CREATE USER {name} WITH PASSWORD '***'"),
            UserChange::Alter { name, .. } => format!("ALTER USER {name} WITH PASSWORD '***'"),
            UserChange::Drop { name } => format!("DROP USER {name}"),
        }
    }

    pub fn name(&self) -> &str {
        match &self.change {
            UserChange::Create { name, .. }
            | UserChange::Alter { name, .. }
            | UserChange::Drop { name } => name,
        }
    }
}

/// `Some` if `sql` is a user statement (the whole text: one statement, perhaps with a
/// trailing `;`), parsed or with the error that names what is wrong; `None` for any other
/// SQL.
pub fn parse_user_statement(sql: &str) -> Option<Result<UserStatement>> {
    let mut tokens = Tokens::of(sql)?;
    let verb = tokens.keyword_of(&[Keyword::CREATE, Keyword::ALTER, Keyword::DROP])?;
    tokens.keyword_of(&[Keyword::USER, Keyword::ROLE])?;
    Some(tokens.user_statement(verb))
}

impl Tokens {
    fn password(&mut self) -> Result<ScramSecret> {
        match self.tokens.get(self.at) {
            Some(Token::SingleQuotedString(password)) => {
                self.at += 1;
                if password.is_empty() {
                    return Err(syntax("a password may not be empty"));
                }
                Ok(ScramSecret::from_verifier(password)
                    .unwrap_or_else(|| ScramSecret::new(password)))
            }
            other => Err(syntax(format!(
                "expected the password as a quoted string after PASSWORD, found {}",
                describe(other)
            ))),
        }
    }

    /// `[WITH] [LOGIN] PASSWORD '...' [LOGIN] [IN PARTICIPANT p]`: the options Tessera's
    /// users have (a participant only where `participant` may take one: CREATE).
    fn options(
        &mut self,
        verb: &str,
        mut participant: Option<&mut Option<String>>,
    ) -> Result<ScramSecret> {
        self.keyword_of(&[Keyword::WITH]);
        let mut secret = None;
        while let Some(token) = self.peek().cloned() {
            if matches!(token, Token::SemiColon | Token::EOF) {
                break;
            }
            if self.keyword_of(&[Keyword::LOGIN]).is_some() {
                continue;
            }
            if self.keyword_of(&[Keyword::PASSWORD]).is_some() {
                secret = Some(self.password()?);
                continue;
            }
            if let Some(slot) = participant.as_deref_mut() {
                if self.keyword_of(&[Keyword::IN]).is_some() {
                    if !self.word("participant") {
                        return Err(syntax(format!(
                            "expected PARTICIPANT after IN, found {}",
                            describe(self.peek())
                        )));
                    }
                    *slot = Some(self.name("a participant name")?);
                    continue;
                }
            }
            return Err(SqlError::Unsupported(format!(
                "{verb} USER option {}: Tessera's users have a password and a participant (IN PARTICIPANT p), and nothing else yet",
                describe(Some(&token))
            )));
        }
        secret.ok_or_else(|| syntax(format!("{verb} USER needs WITH PASSWORD '...'")))
    }

    fn user_statement(&mut self, verb: Keyword) -> Result<UserStatement> {
        let statement = match verb {
            Keyword::CREATE => {
                let tolerant = self.keywords(&[Keyword::IF, Keyword::NOT, Keyword::EXISTS]);
                let name = self.name("a user name")?;
                let mut participant = None;
                let secret = self.options("CREATE", Some(&mut participant))?;
                UserStatement {
                    change: UserChange::Create {
                        name,
                        secret,
                        participant,
                    },
                    tolerant,
                }
            }
            Keyword::ALTER => {
                let name = self.name("a user name")?;
                let secret = self.options("ALTER", None)?;
                UserStatement {
                    change: UserChange::Alter { name, secret },
                    tolerant: false,
                }
            }
            _ => {
                let tolerant = self.keywords(&[Keyword::IF, Keyword::EXISTS]);
                let name = self.name("a user name")?;
                UserStatement {
                    change: UserChange::Drop { name },
                    tolerant,
                }
            }
        };
        self.end("user")?;
        Ok(statement)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(sql: &str) -> UserStatement {
        parse_user_statement(sql)
            .expect("a user statement")
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    fn error(sql: &str) -> String {
        parse_user_statement(sql)
            .expect("a user statement")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn postgres_spellings_parse_and_hide_their_password() {
        let create = parsed("create user Ada with password 'pencil';");
        let UserChange::Create {
            name,
            secret,
            participant: None,
        } = &create.change
        else {
            panic!("{create:?}")
        };
        assert_eq!(name, "ada", "unquoted names fold to lower case");
        assert!(secret.verify_password("pencil"));
        assert_eq!(create.redacted(), "CREATE USER ada WITH PASSWORD '***'");
        assert_eq!(create.tag(), "CREATE ROLE");

        let member = parsed("CREATE USER bo IN PARTICIPANT Lab_B PASSWORD 'x'");
        let UserChange::Create { participant, .. } = &member.change else {
            panic!("{member:?}")
        };
        assert_eq!(participant.as_deref(), Some("lab_b"));
        assert_eq!(
            member.redacted(),
            "CREATE USER bo WITH PASSWORD '***' IN PARTICIPANT lab_b"
        );

        let role = parsed("CREATE ROLE \"Bob\" WITH LOGIN PASSWORD 'x'");
        assert_eq!(role.name(), "Bob");
        assert!(parsed("CREATE USER IF NOT EXISTS c PASSWORD 'x'").tolerant);
        let alter = parsed("ALTER USER ada PASSWORD 'new'");
        assert!(matches!(alter.change, UserChange::Alter { .. }));
        assert_eq!(
            parsed("DROP USER IF EXISTS ada").change,
            UserChange::Drop { name: "ada".into() }
        );
    }

    #[test]
    fn a_scram_verifier_is_stored_as_given() {
        let secret = ScramSecret::new("pencil");
        let verifier = secret.to_verifier();
        let alter = parsed(&format!("ALTER USER ada PASSWORD '{verifier}'"));
        assert_eq!(
            alter.change,
            UserChange::Alter {
                name: "ada".into(),
                secret
            }
        );
    }

    #[test]
    fn other_sql_is_not_a_user_statement() {
        for sql in [
            "SELECT 1",
            "CREATE TABLE users (id INT)",
            "DROP TABLE users",
            "-- CREATE USER x\nSELECT 1",
        ] {
            assert!(parse_user_statement(sql).is_none(), "{sql}");
        }
    }

    #[test]
    fn mistakes_are_named() {
        assert!(error("CREATE USER ada").contains("needs WITH PASSWORD"));
        assert!(error("CREATE USER ada WITH PASSWORD pencil").contains("quoted string"));
        assert!(error("CREATE USER ada WITH SUPERUSER PASSWORD 'x'").contains("SUPERUSER"));
        assert!(error("CREATE USER ada PASSWORD ''").contains("may not be empty"));
        assert!(error("DROP USER a; SELECT 1").contains("send it on its own"));
        assert!(error("DROP USER").contains("expected a user name"));
        assert!(error("CREATE USER a PASSWORD 'x' IN lab").contains("PARTICIPANT after IN"));
        assert!(error("ALTER USER a PASSWORD 'x' IN PARTICIPANT p").contains("ALTER USER option"));
    }
}
