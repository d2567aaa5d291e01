//! Who may do what: participants (the organizations sharing the cluster), their users'
//! roles, table ownership (Chimera's one owner per table) and the audit log.
//!
//! Every rule is checked here, in the state machine, where every node applies it in the
//! same order: a command proposed on behalf of a user arrives wrapped as
//! [`MetaCommand::As`](crate::MetaCommand::As), and is refused if that user may not do it.
//! Deciding in Raft order is what makes an ownership hand-over exact: a publish's epoch is
//! allocated (under the table's one-writer lease) either before the hand-over, when it
//! must commit before the hand-over is applied or be aborted by it, or after it, when the
//! new owner's rules refuse it.
//!
//! Standings, from most to least:
//! - the cluster's operator: a command not wrapped (the node itself, a client on an open
//!   cluster or over the internal port with the administrator's certificate), and any
//!   user who belongs to no participant (a cluster administrator); may do everything;
//! - a member: a user of one participant, with roles. `reader` may query; `writer` also
//!   publishes to (and alters) the tables its participant owns and creates tables, which
//!   its participant then owns; `admin` also manages its participant's users and roles,
//!   drops its tables and hands them over to another participant.

use crate::state::{LocalEffect, MetaCommand, MetaResponse, MetaState};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt;
use tessera_common::auth::ScramSecret;
use tessera_common::Epoch;

/// A member's role. Each includes the rights of those before it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Reader,
    Writer,
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Reader, Role::Writer, Role::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Writer => "writer",
            Role::Admin => "admin",
        }
    }

    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL
            .into_iter()
            .find(|r| r.name().eq_ignore_ascii_case(name))
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An organization sharing the cluster: it owns tables and has users.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ParticipantRecord {
    pub created_at_ms: u64,
    /// Its public signing keys (hex), oldest first: an epoch it publishes must be signed
    /// with one of them once it has any (see [`crate::seal`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<RegisteredKey>,
}

/// A participant's public signing key.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RegisteredKey {
    /// The ed25519 public key, hex.
    pub key: String,
    /// The first epoch allocated after it was registered: the participant's epochs from
    /// there on must be signed.
    pub from: Epoch,
}

/// One entry of the audit log: who changed membership, rights or ownership, or published.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AuditRecord {
    /// The metadata's clock when it was applied (milliseconds since the Unix epoch).
    pub at_ms: u64,
    /// The user who did it; `None` for the cluster's operator.
    pub by: Option<String>,
    pub event: AuditEvent,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AuditEvent {
    CreateParticipant {
        name: String,
    },
    DropParticipant {
        name: String,
    },
    CreateUser {
        name: String,
        participant: Option<String>,
    },
    /// A new password.
    AlterUser {
        name: String,
    },
    DropUser {
        name: String,
    },
    Grant {
        user: String,
        role: Role,
    },
    Revoke {
        user: String,
        role: Role,
    },
    CreateTable {
        table: String,
        owner: Option<String>,
    },
    DropTable {
        table: String,
    },
    /// Ownership moved; the open epochs of publishers the new owner does not admit were
    /// aborted in the same entry.
    HandOver {
        table: String,
        from: Option<String>,
        to: String,
        aborted: Vec<Epoch>,
    },
    Publish {
        epoch: Epoch,
        tables: Vec<String>,
        participant: Option<String>,
    },
    /// A public key registered for the participant's signatures.
    AddKey {
        participant: String,
        key: String,
    },
}

impl AuditEvent {
    /// The event's kind, as the audit table shows it.
    pub fn kind(&self) -> &'static str {
        match self {
            AuditEvent::CreateParticipant { .. } => "create participant",
            AuditEvent::DropParticipant { .. } => "drop participant",
            AuditEvent::CreateUser { .. } => "create user",
            AuditEvent::AlterUser { .. } => "alter user",
            AuditEvent::DropUser { .. } => "drop user",
            AuditEvent::Grant { .. } => "grant",
            AuditEvent::Revoke { .. } => "revoke",
            AuditEvent::CreateTable { .. } => "create table",
            AuditEvent::DropTable { .. } => "drop table",
            AuditEvent::HandOver { .. } => "hand over",
            AuditEvent::AddKey { .. } => "add key",
            AuditEvent::Publish { .. } => "publish",
        }
    }
}

impl fmt::Display for AuditEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let owner = |p: &Option<String>| {
            p.as_deref()
                .map_or("no participant".to_string(), |p| format!("participant {p}"))
        };
        match self {
            AuditEvent::CreateParticipant { name } => write!(f, "created participant {name}"),
            AuditEvent::DropParticipant { name } => write!(f, "dropped participant {name}"),
            AuditEvent::CreateUser { name, participant } => {
                write!(f, "created user {name} in {}", owner(participant))
            }
            AuditEvent::AlterUser { name } => write!(f, "changed the password of user {name}"),
            AuditEvent::DropUser { name } => write!(f, "dropped user {name}"),
            AuditEvent::Grant { user, role } => write!(f, "granted {role} to user {user}"),
            AuditEvent::Revoke { user, role } => write!(f, "revoked {role} from user {user}"),
            AuditEvent::CreateTable { table, owner: o } => {
                write!(f, "created table {table}, owned by {}", owner(o))
            }
            AuditEvent::DropTable { table } => write!(f, "dropped table {table}"),
            AuditEvent::HandOver {
                table,
                from,
                to,
                aborted,
            } => {
                write!(
                    f,
                    "handed table {table} over from {} to participant {to}",
                    owner(from)
                )?;
                if !aborted.is_empty() {
                    write!(f, ", aborting the open epochs {aborted:?}")?;
                }
                Ok(())
            }
            AuditEvent::Publish {
                epoch,
                tables,
                participant,
            } => write!(
                f,
                "published epoch {epoch} to {} for {}",
                tables.join(", "),
                owner(participant)
            ),
            AuditEvent::AddKey { participant, key } => write!(
                f,
                "registered signing key {} for participant {participant}",
                crate::seal::short(key)
            ),
        }
    }
}

/// A user of the SQL endpoints: only the SCRAM secret of the password is kept.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct UserRecord {
    pub secret: ScramSecret,
    /// The organization the user acts for; `None` for a cluster administrator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub participant: Option<String>,
    /// A member's roles (a cluster administrator needs none).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub roles: BTreeSet<Role>,
}

impl MetaCommand {
    /// Commands about the cluster's nodes, placement, epochs' fate and queries' lineage,
    /// which only the nodes (or the operator) send.
    pub(crate) fn is_the_clusters_own(&self) -> bool {
        matches!(
            self,
            MetaCommand::Bootstrap { .. }
                | MetaCommand::RegisterNode { .. }
                | MetaCommand::SetLiveness { .. }
                | MetaCommand::Started { .. }
                | MetaCommand::SetPartitionMap { .. }
                | MetaCommand::Leave { .. }
                | MetaCommand::Decommission { .. }
                | MetaCommand::Lineage { .. }
                | MetaCommand::LineageEnd { .. }
                | MetaCommand::AbortEpoch { .. }
                | MetaCommand::MarkCorrupt { .. }
        )
    }
}

/// How every refusal for want of a right begins.
pub const DENIED: &str = "permission denied: ";

/// Where the one acting stands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Standing<'a> {
    /// The cluster's operator or a cluster administrator (a user of no participant).
    Operator,
    Member {
        user: &'a str,
        participant: &'a str,
        roles: &'a BTreeSet<Role>,
    },
}

impl Standing<'_> {
    fn has(&self, role: Role) -> bool {
        match self {
            Standing::Operator => true,
            Standing::Member { roles, .. } => roles.iter().any(|r| *r >= role),
        }
    }
}

/// What the one acting asks to do.
#[derive(Debug, Clone, Copy)]
pub enum Action<'a> {
    Read,
    Publish(&'a str),
    CreateTable,
    AlterTable(&'a str),
    DropTable(&'a str),
    HandOver(&'a str),
    /// Tags and retention settings: they change what history is kept.
    KeepHistory,
    ManageParticipants,
    /// Create or drop a user of this participant (`None`: a cluster administrator), or
    /// grant or revoke its roles.
    ManageUser(Option<&'a str>),
    /// A new password for this user.
    ChangePassword(&'a str),
    /// Register a signing key for this participant.
    ManageKeys(&'a str),
}

/// "user bob (participant lab_b, roles reader)".
fn describe(standing: &Standing) -> String {
    match standing {
        Standing::Operator => "the operator".into(),
        Standing::Member {
            user,
            participant,
            roles,
        } => {
            let roles: Vec<&str> = roles.iter().map(|r| r.name()).collect();
            let roles = if roles.is_empty() {
                "no role".to_string()
            } else {
                format!("role {}", roles.join(", "))
            };
            format!("user {user} (participant {participant}, {roles})")
        }
    }
}

impl MetaState {
    /// Where `by` stands: `None` is the operator; an unknown user is refused.
    pub fn standing<'a>(&'a self, by: Option<&'a str>) -> Result<Standing<'a>, String> {
        let Some(name) = by else {
            return Ok(Standing::Operator);
        };
        let user = self
            .users
            .get(name)
            .ok_or_else(|| format!("user {name:?} does not exist"))?;
        Ok(match &user.participant {
            None => Standing::Operator,
            Some(participant) => Standing::Member {
                user: name,
                participant,
                roles: &user.roles,
            },
        })
    }

    /// The participant that owns `table`, if any (tables the operator created and handed
    /// to nobody have none).
    pub fn table_owner(&self, table: &str) -> Option<&str> {
        self.owners.get(table).map(String::as_str)
    }

    /// Whether `by` may do `action`; if not, why, in words that name the user, the right
    /// it lacks and what it would need: "permission denied: ...".
    pub fn may(&self, by: Option<&str>, action: Action) -> Result<(), String> {
        let standing = self.standing(by)?;
        let Standing::Member { participant, .. } = standing else {
            return Ok(());
        };
        let denied = |what: String| Err(format!("{DENIED}{} {what}", describe(&standing)));
        let needs = |role: Role, what: &str| {
            if standing.has(role) {
                Ok(())
            } else {
                denied(format!("may not {what}: it needs the {role} role"))
            }
        };
        let owned = |table: &str, role: Role, what: &str| -> Result<(), String> {
            match self.table_owner(table) {
                Some(owner) if owner == participant => needs(role, &format!("{what} table {table:?}")),
                Some(owner) => denied(format!(
                    "may not {what} table {table:?}: participant {owner} owns it"
                )),
                None => denied(format!(
                    "may not {what} table {table:?}: it has no owner, so only a cluster administrator may (ALTER TABLE {table} OWNER TO gives it one)"
                )),
            }
        };
        match action {
            Action::Read => needs(Role::Reader, "read"),
            Action::Publish(table) => owned(table, Role::Writer, "publish to"),
            Action::AlterTable(table) => owned(table, Role::Writer, "alter"),
            Action::DropTable(table) => owned(table, Role::Admin, "drop"),
            Action::HandOver(table) => owned(table, Role::Admin, "hand over"),
            Action::CreateTable => needs(Role::Writer, "create tables"),
            Action::KeepHistory => needs(Role::Writer, "change tags or retention"),
            Action::ManageParticipants => denied(
                "may not create or drop participants: only a cluster administrator may".into(),
            ),
            Action::ManageUser(Some(theirs)) if theirs == participant => {
                needs(Role::Admin, "manage users")
            }
            Action::ManageUser(Some(theirs)) => {
                denied(format!("may not manage the users of participant {theirs}"))
            }
            Action::ManageUser(None) => {
                denied("may not manage cluster administrators (users of no participant)".into())
            }
            Action::ManageKeys(theirs) if theirs == participant => {
                needs(Role::Admin, "register signing keys")
            }
            Action::ManageKeys(theirs) => denied(format!(
                "may not register signing keys for participant {theirs}"
            )),
            Action::ChangePassword(user) if Some(user) == by => Ok(()),
            Action::ChangePassword(user) => {
                let theirs = self.users.get(user).and_then(|u| u.participant.as_deref());
                self.may(by, Action::ManageUser(theirs))
            }
        }
    }

    /// Appends to the audit log, stamped with the metadata's clock.
    pub(crate) fn audit(&mut self, by: Option<&str>, event: AuditEvent) {
        self.audit_log.push_back(AuditRecord {
            at_ms: self.clock_ms,
            by: by.map(str::to_string),
            event,
        });
    }

    /// Hands `table` over to `to` in one entry: the open epochs leasing it whose publisher
    /// the new owner would refuse are aborted (their publishes are refused, nothing of them
    /// becomes visible), so the new owner may publish at once. Answers the aborted epochs.
    pub(crate) fn hand_over(
        &mut self,
        table: &str,
        to: &str,
        by: Option<&str>,
    ) -> Result<Vec<Epoch>, String> {
        if !self.tables.contains_key(table) {
            return Err(format!("table {table:?} does not exist"));
        }
        if !self.participants.contains_key(to) {
            return Err(format!("participant {to:?} does not exist"));
        }
        self.may(by, Action::HandOver(table))?;
        let from = self.owners.insert(table.to_string(), to.to_string());
        let refused: Vec<Epoch> = self
            .open
            .iter()
            .filter(|(_, open)| open.tables.iter().any(|t| t == table))
            .filter(|(_, open)| {
                open.publisher.is_some()
                    && open.tables.iter().any(|t| {
                        self.may(open.publisher.as_deref(), Action::Publish(t))
                            .is_err()
                    })
            })
            .map(|(epoch, _)| *epoch)
            .collect();
        for epoch in &refused {
            self.note_abort(
                *epoch,
                format!("table {table:?} was handed over to participant {to} while it was being published"),
            );
        }
        self.audit(
            by,
            AuditEvent::HandOver {
                table: table.to_string(),
                from,
                to: to.to_string(),
                aborted: refused.clone(),
            },
        );
        Ok(refused)
    }

    /// GRANT (`granting`) or REVOKE `role` for `user`, a member of a participant.
    pub(crate) fn change_role(
        &mut self,
        user: &str,
        role: Role,
        granting: bool,
        by: Option<&str>,
    ) -> Result<(), String> {
        let record = self
            .users
            .get(user)
            .ok_or_else(|| format!("user {user:?} does not exist"))?;
        let Some(participant) = record.participant.clone() else {
            return Err(format!(
                "user {user:?} is a cluster administrator (of no participant), who may already do everything: roles are for members of a participant"
            ));
        };
        self.may(by, Action::ManageUser(Some(&participant)))?;
        let roles = &mut self.users.get_mut(user).expect("checked").roles;
        let user = user.to_string();
        if granting {
            roles.insert(role);
            self.audit(by, AuditEvent::Grant { user, role });
        } else {
            roles.remove(&role);
            self.audit(by, AuditEvent::Revoke { user, role });
        }
        Ok(())
    }

    /// Why `epoch` was aborted, for the coordinator that asks to commit it; kept for the
    /// newest few only (a coordinator asks within seconds).
    pub(crate) fn note_abort(&mut self, epoch: Epoch, reason: String) {
        const KEPT: usize = 256;
        self.abort_reasons.insert(epoch, reason);
        while self.abort_reasons.len() > KEPT {
            self.abort_reasons.pop_first();
        }
    }
}

impl MetaState {
    /// Applies a command about users, participants, roles or ownership on behalf of `by`.
    pub(crate) fn apply_access(
        &mut self,
        command: MetaCommand,
        by: Option<&str>,
        effects: &mut Vec<LocalEffect>,
    ) -> Result<MetaResponse, String> {
        Ok(match command {
            MetaCommand::CreateUser {
                name,
                secret,
                participant,
            } => {
                if self.users.contains_key(&name) {
                    return Err(format!("user {name:?} already exists"));
                }
                if let Some(p) = participant
                    .as_ref()
                    .filter(|p| !self.participants.contains_key(*p))
                {
                    return Err(format!("participant {p:?} does not exist"));
                }
                self.may(by, Action::ManageUser(participant.as_deref()))?;
                // A member may read from the start; writing and administering are granted.
                let roles = match participant {
                    Some(_) => BTreeSet::from([Role::Reader]),
                    None => BTreeSet::new(),
                };
                self.audit(
                    by,
                    AuditEvent::CreateUser {
                        name: name.clone(),
                        participant: participant.clone(),
                    },
                );
                self.users.insert(
                    name,
                    UserRecord {
                        secret,
                        participant,
                        roles,
                    },
                );
                MetaResponse::Done
            }
            MetaCommand::AlterUser { name, secret } => {
                if !self.users.contains_key(&name) {
                    return Err(format!("user {name:?} does not exist"));
                }
                self.may(by, Action::ChangePassword(&name))?;
                self.audit(by, AuditEvent::AlterUser { name: name.clone() });
                self.users.get_mut(&name).expect("checked").secret = secret;
                MetaResponse::Done
            }
            MetaCommand::DropUser { name } => {
                let user = self
                    .users
                    .get(&name)
                    .ok_or_else(|| format!("user {name:?} does not exist"))?;
                self.may(by, Action::ManageUser(user.participant.as_deref()))?;
                self.users.remove(&name);
                self.audit(by, AuditEvent::DropUser { name });
                MetaResponse::Done
            }
            MetaCommand::CreateParticipant { name } => {
                self.may(by, Action::ManageParticipants)?;
                if self.participants.contains_key(&name) {
                    return Err(format!("participant {name:?} already exists"));
                }
                self.participants.insert(
                    name.clone(),
                    ParticipantRecord {
                        created_at_ms: self.clock_ms,
                        keys: Vec::new(),
                    },
                );
                self.audit(by, AuditEvent::CreateParticipant { name });
                MetaResponse::Done
            }
            MetaCommand::DropParticipant { name } => {
                self.may(by, Action::ManageParticipants)?;
                if !self.participants.contains_key(&name) {
                    return Err(format!("participant {name:?} does not exist"));
                }
                if let Some((table, _)) = self.owners.iter().find(|(_, owner)| **owner == name) {
                    return Err(format!(
                        "participant {name:?} still owns table {table:?}: hand it over or drop it first"
                    ));
                }
                if let Some((user, _)) = self
                    .users
                    .iter()
                    .find(|(_, u)| u.participant.as_ref() == Some(&name))
                {
                    return Err(format!(
                        "participant {name:?} still has user {user:?}: drop its users first"
                    ));
                }
                self.participants.remove(&name);
                self.audit(by, AuditEvent::DropParticipant { name });
                MetaResponse::Done
            }
            MetaCommand::Grant { user, role } => {
                self.change_role(&user, role, true, by)?;
                MetaResponse::Done
            }
            MetaCommand::Revoke { user, role } => {
                self.change_role(&user, role, false, by)?;
                MetaResponse::Done
            }
            MetaCommand::AddParticipantKey { participant, key } => {
                self.may(by, Action::ManageKeys(&participant))?;
                tessera_common::signing::check_public_key(&key)?;
                let record = self
                    .participants
                    .get_mut(&participant)
                    .ok_or_else(|| format!("participant {participant:?} does not exist"))?;
                if !record.keys.iter().any(|k| k.key == key) {
                    record.keys.push(RegisteredKey {
                        key: key.clone(),
                        from: self.next_epoch,
                    });
                    self.audit(by, AuditEvent::AddKey { participant, key });
                }
                MetaResponse::Done
            }
            MetaCommand::SetTableOwner { table, owner } => {
                let refused = self.hand_over(&table, &owner, by)?;
                for epoch in refused {
                    tracing::info!(%epoch, %table, %owner, "epoch aborted by a hand-over");
                    self.decide(epoch, false);
                    effects.push(LocalEffect::Abort(epoch));
                }
                MetaResponse::Done
            }
            other => unreachable!("not an access command: {other:?}"),
        })
    }
}
