//! `CREATE TAG name [AT EPOCH n]` and `DROP TAG [IF EXISTS] name`: names pinned to epochs,
//! read with `AS OF TAG name`. Tags live in the cluster's metadata, next to the epoch log,
//! or, for a store on its own, in its checkpoint ([`tessera_storage::history`]).

use crate::error::{Result, SqlError};
use crate::statements::{syntax, Tokens};
use datafusion::sql::sqlparser::keywords::Keyword;

/// The longest tag name accepted.
pub const MAX_TAG_NAME: usize = 63;

/// A parsed tag statement.
#[derive(Debug, Clone, PartialEq)]
pub enum TagStatement {
    Create {
        name: String,
        /// `AT EPOCH n`; the visible epoch when `None`.
        epoch: Option<u64>,
        /// `IF NOT EXISTS`.
        tolerant: bool,
    },
    Drop {
        name: String,
        /// `IF EXISTS`.
        tolerant: bool,
    },
}

impl TagStatement {
    pub fn command_tag(&self) -> &'static str {
        match self {
            TagStatement::Create { .. } => "CREATE TAG",
            TagStatement::Drop { .. } => "DROP TAG",
        }
    }

    pub fn name(&self) -> &str {
        match self {
            TagStatement::Create { name, .. } | TagStatement::Drop { name, .. } => name,
        }
    }

    /// Whether `IF [NOT] EXISTS` was given.
    pub fn tolerant(&self) -> bool {
        match self {
            TagStatement::Create { tolerant, .. } | TagStatement::Drop { tolerant, .. } => {
                *tolerant
            }
        }
    }
}

impl std::fmt::Display for TagStatement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TagStatement::Create { name, epoch, .. } => {
                write!(f, "CREATE TAG {name}")?;
                match epoch {
                    Some(epoch) => write!(f, " AT EPOCH {epoch}"),
                    None => Ok(()),
                }
            }
            TagStatement::Drop { name, .. } => write!(f, "DROP TAG {name}"),
        }
    }
}

/// A tag name is a word of letters, digits, `_`, `-` and `.`: it travels inside catalog
/// names (`t@tag:name`), so nothing else is allowed.
pub fn check_tag_name(name: &str) -> Result<()> {
    let fine = !name.is_empty()
        && name.len() <= MAX_TAG_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if fine {
        Ok(())
    } else {
        Err(SqlError::Syntax(format!(
            "tag name {name:?}: use 1 to {MAX_TAG_NAME} letters, digits, '_', '-' or '.'"
        )))
    }
}

/// `Some` if `sql` is a tag statement, parsed or with the error that names what is wrong.
pub fn parse_tag_statement(sql: &str) -> Option<Result<TagStatement>> {
    let mut tokens = Tokens::of(sql)?;
    let verb = tokens.keyword_of(&[Keyword::CREATE, Keyword::DROP])?;
    if !tokens.word("TAG") {
        return None;
    }
    Some(tokens.tag_statement(verb))
}

impl Tokens {
    fn tag_statement(&mut self, verb: Keyword) -> Result<TagStatement> {
        let statement = if verb == Keyword::CREATE {
            let tolerant = self.keywords(&[Keyword::IF, Keyword::NOT, Keyword::EXISTS]);
            let name = self.name("a tag name")?;
            let epoch = if self.keyword_of(&[Keyword::AT]).is_some() {
                if !self.word("EPOCH") {
                    return Err(syntax("CREATE TAG ... AT needs EPOCH n"));
                }
                Some(self.number("an epoch number after AT EPOCH")?)
            } else {
                None
            };
            TagStatement::Create {
                name,
                epoch,
                tolerant,
            }
        } else {
            let tolerant = self.keywords(&[Keyword::IF, Keyword::EXISTS]);
            TagStatement::Drop {
                name: self.name("a tag name")?,
                tolerant,
            }
        };
        check_tag_name(statement.name())?;
        self.end("tag")?;
        Ok(statement)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(sql: &str) -> TagStatement {
        parse_tag_statement(sql)
            .expect("a tag statement")
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    fn error(sql: &str) -> String {
        parse_tag_statement(sql)
            .expect("a tag statement")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn tag_statements_parse() {
        assert_eq!(
            parsed("create tag Release_1;"),
            TagStatement::Create {
                name: "release_1".into(),
                epoch: None,
                tolerant: false
            }
        );
        assert_eq!(
            parsed("CREATE TAG IF NOT EXISTS \"v1.0\" AT EPOCH 42"),
            TagStatement::Create {
                name: "v1.0".into(),
                epoch: Some(42),
                tolerant: true
            }
        );
        assert_eq!(
            parsed("DROP TAG IF EXISTS nightly"),
            TagStatement::Drop {
                name: "nightly".into(),
                tolerant: true
            }
        );
        assert!(parse_tag_statement("CREATE TABLE tag (a INT)").is_none());
        assert!(parse_tag_statement("SELECT * FROM tag").is_none());
    }

    #[test]
    fn mistakes_are_named() {
        assert!(error("CREATE TAG").contains("expected a tag name"));
        assert!(error("CREATE TAG x AT 5").contains("AT needs EPOCH"));
        assert!(error("CREATE TAG x AT EPOCH -1").contains("epoch number"));
        assert!(error("CREATE TAG \"a@b\"").contains("letters, digits"));
        assert!(error("DROP TAG x y").contains("send it on its own"));
    }
}
