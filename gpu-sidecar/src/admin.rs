//! The kill switch and who may flip it: a bearer token of at least
//! [`MIN_TOKEN_BYTES`] compared in constant time, and a state file written
//! atomically so a restart keeps the switch. How fast a client may guess
//! the token is [`crate::door`]'s.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::alerts::{AlertEvent, Alerts};
use crate::door::Failure;
use crate::state::{KillSwitch, StateStore};

/// The shortest admin token accepted at start: 16 bytes (`openssl rand
/// -hex 16` makes 32). Shorter ones are refused, so the token cannot be a
/// word a guesser tries first.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The admin bearer token; `None`: no admin call is accepted.
#[derive(Clone, Default)]
pub struct AdminToken(Option<Vec<u8>>);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "AdminToken(set)"
        } else {
            "AdminToken(none)"
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("reading the admin token file {0}: {1}")]
    TokenFile(PathBuf, std::io::Error),
    #[error("the admin token file {0} is empty")]
    EmptyToken(PathBuf),
    #[error(
        "the admin token from {from} is {len} bytes; at least {MIN_TOKEN_BYTES} are required \
         (make one with `openssl rand -hex 16`)"
    )]
    ShortToken { from: String, len: usize },
    #[error("reading the state file {0}: {1}")]
    StateRead(PathBuf, std::io::Error),
    #[error("the state file {0} is not what this sidecar wrote ({1}); fix or remove it")]
    StateParse(PathBuf, serde_json::Error),
}

impl AdminToken {
    /// From `file` if given (surrounding whitespace trimmed), else from
    /// `env_value` (`SLUICE_ADMIN_TOKEN`) when it is not empty. `file_from`
    /// names where the file came from (`--admin-token-file`,
    /// `admin.token_file`), for the error about a short token.
    pub fn load(
        file: Option<&Path>,
        file_from: &str,
        env_value: Option<String>,
    ) -> Result<AdminToken, AdminError> {
        let (token, from) = if let Some(path) = file {
            let text =
                std::fs::read_to_string(path).map_err(|e| AdminError::TokenFile(path.into(), e))?;
            let token = text.trim().to_string();
            if token.is_empty() {
                return Err(AdminError::EmptyToken(path.into()));
            }
            (token, format!("{file_from} ({})", path.display()))
        } else {
            match env_value
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
            {
                Some(token) => (token, "SLUICE_ADMIN_TOKEN".to_string()),
                None => return Ok(AdminToken(None)),
            }
        };
        if token.len() < MIN_TOKEN_BYTES {
            return Err(AdminError::ShortToken {
                from,
                len: token.len(),
            });
        }
        Ok(AdminToken(Some(token.into_bytes())))
    }

    pub fn new(token: &str) -> AdminToken {
        AdminToken(Some(token.as_bytes().to_vec()))
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// Whether an `Authorization` header value carries the token.
    pub fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        self.check(authorization).is_ok()
    }

    /// Whether an `Authorization` header value carries the token, and if
    /// not, why: no bearer token given, a wrong one, or none configured.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), Failure> {
        let Some(want) = &self.0 else {
            return Err(Failure::NotConfigured);
        };
        // The scheme is case-insensitive (RFC 9110 §11.1).
        let Some(given) = authorization.and_then(|header| {
            header
                .get(..7)
                .filter(|scheme| scheme.eq_ignore_ascii_case(b"Bearer "))
                .map(|_| &header[7..])
        }) else {
            return Err(Failure::Missing);
        };
        // Only the length can show, and a token has at least MIN_TOKEN_BYTES.
        if crate::door::secret_eq(given, want) {
            Ok(())
        } else {
            Err(Failure::Wrong)
        }
    }
}

/// What the state file holds.
#[derive(Debug, Serialize, Deserialize)]
struct Persisted {
    kill_switch: KillSwitch,
}

/// The kill switch as last saved in `path`; off when there is no file.
pub fn load_kill_switch(path: &Path) -> Result<KillSwitch, AdminError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice::<Persisted>(&bytes)
            .map(|p| p.kill_switch)
            .map_err(|e| AdminError::StateParse(path.into(), e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(KillSwitch::default()),
        Err(e) => Err(AdminError::StateRead(path.into(), e)),
    }
}

/// Writes a temp file beside `path`, syncs it, renames it over `path` and
/// syncs the folder: after a crash the file is the old or the new one.
pub fn save_kill_switch(path: &Path, ks: &KillSwitch) -> std::io::Result<()> {
    let body = serde_json::to_vec_pretty(&Persisted {
        kill_switch: ks.clone(),
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map_or_else(|| "state".into(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&body)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    // Makes the rename itself durable; not every platform can open a folder.
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// What an admin change did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KillSwitchOutcome {
    pub kill_switch: KillSwitch,
    pub version: u64,
    /// Saved to the state file (false with no state file, or when saving
    /// failed: the switch still holds until restart).
    pub persisted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// Flips the kill switch: saves, publishes, alerts. One at a time, so the
/// file and the published state agree.
#[derive(Debug)]
pub struct KillSwitchControl {
    store: StateStore,
    state_file: Option<PathBuf>,
    alerts: Option<Alerts>,
    lock: tokio::sync::Mutex<()>,
}

impl KillSwitchControl {
    pub fn new(store: StateStore, state_file: Option<PathBuf>, alerts: Option<Alerts>) -> Self {
        KillSwitchControl {
            store,
            state_file,
            alerts,
            lock: tokio::sync::Mutex::new(()),
        }
    }

    pub async fn set(
        &self,
        active: bool,
        reason: Option<String>,
        now: SystemTime,
    ) -> KillSwitchOutcome {
        let _one_at_a_time = self.lock.lock().await;
        let old = self.store.current().kill_switch.clone();
        let next = KillSwitch {
            active,
            reason,
            since: if old.active == active {
                old.since
            } else {
                Some(now)
            },
        };
        let mut warning = None;
        let persisted = match &self.state_file {
            None => {
                warning =
                    Some("no state file configured: a restart forgets the kill switch".into());
                false
            }
            Some(path) => {
                let path = path.clone();
                let ks = next.clone();
                match tokio::task::spawn_blocking(move || save_kill_switch(&path, &ks)).await {
                    Ok(Ok(())) => true,
                    Ok(Err(e)) => {
                        warning = Some(format!("not saved: {e}"));
                        false
                    }
                    Err(e) => {
                        warning = Some(format!("not saved: {e}"));
                        false
                    }
                }
            }
        };
        if let Some(w) = &warning {
            if self.state_file.is_some() {
                eprintln!("sluice-sidecar: kill switch: {w}");
            }
        }
        // Applied even when saving failed: an operator pulling the switch
        // in an incident must not be refused over a full disk.
        self.store.update(now, |s| s.kill_switch = next.clone());
        if old.active != active {
            eprintln!(
                "sluice-sidecar: kill switch {} ({})",
                if active { "ON" } else { "off" },
                next.reason.as_deref().unwrap_or("no reason given")
            );
            if let Some(a) = &self.alerts {
                a.send(AlertEvent::KillSwitch {
                    active,
                    reason: next.reason.clone(),
                    at: now,
                });
            }
        }
        KillSwitchOutcome {
            kill_switch: next,
            version: self.store.current().version,
            persisted,
            warning,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn token_checks() {
        let t = AdminToken::new("s3cret");
        assert!(t.accepts(Some(b"Bearer s3cret")));
        assert!(t.accepts(Some(b"bearer s3cret")));
        assert!(!t.accepts(Some(b"Bearer s3cret ")));
        assert!(!t.accepts(Some(b"Bearer s3cre")));
        assert!(!t.accepts(Some(b"s3cret")));
        assert!(!t.accepts(None));
        assert!(!AdminToken::default().accepts(Some(b"Bearer ")));
        assert_eq!(format!("{t:?}"), "AdminToken(set)");
    }

    #[test]
    fn token_checks_say_why() {
        let t = AdminToken::new("s3cret-s3cret-s3cret");
        assert_eq!(t.check(Some(b"Bearer s3cret-s3cret-s3cret")), Ok(()));
        assert_eq!(t.check(Some(b"Bearer nope")), Err(Failure::Wrong));
        assert_eq!(t.check(Some(b"Bearer ")), Err(Failure::Wrong));
        assert_eq!(t.check(Some(b"Basic x")), Err(Failure::Missing));
        assert_eq!(t.check(None), Err(Failure::Missing));
        assert_eq!(
            AdminToken::default().check(Some(b"Bearer x")),
            Err(Failure::NotConfigured)
        );
    }

    #[test]
    fn token_sources() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "  from-file-0123456789\n").unwrap();
        let env = || Some("from-env-0123456789".to_string());
        let t = AdminToken::load(Some(&file), "--admin-token-file", env()).unwrap();
        assert!(t.accepts(Some(b"Bearer from-file-0123456789")));
        let t = AdminToken::load(None, "-", env()).unwrap();
        assert!(t.accepts(Some(b"Bearer from-env-0123456789")));
        assert!(!AdminToken::load(None, "-", Some("  ".into()))
            .unwrap()
            .is_set());
        std::fs::write(&file, "\n").unwrap();
        assert!(AdminToken::load(Some(&file), "-", None).is_err());
        assert!(AdminToken::load(Some(&dir.path().join("nope")), "-", None).is_err());
    }

    #[test]
    fn short_tokens_are_refused_naming_where_they_came_from() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "x\n").unwrap();
        let err = AdminToken::load(Some(&file), "admin.token_file", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("admin.token_file"), "{err}");
        assert!(err.contains("is 1 bytes; at least 16"), "{err}");
        let err = AdminToken::load(None, "-", Some("fifteen-bytes!!".into()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("SLUICE_ADMIN_TOKEN"), "{err}");
        let ok = "sixteen-bytes!!!";
        assert_eq!(ok.len(), MIN_TOKEN_BYTES);
        assert!(AdminToken::load(None, "-", Some(ok.into()))
            .unwrap()
            .is_set());
    }

    #[test]
    fn state_file_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        assert_eq!(load_kill_switch(&path).unwrap(), KillSwitch::default());
        let ks = KillSwitch {
            active: true,
            reason: Some("GPU fire".into()),
            since: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
        };
        save_kill_switch(&path, &ks).unwrap();
        assert_eq!(load_kill_switch(&path).unwrap(), ks);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
        std::fs::write(&path, "{").unwrap();
        assert!(load_kill_switch(&path).is_err());
    }

    #[tokio::test]
    async fn control_saves_publishes_and_keeps_since() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let store = StateStore::new(SystemTime::UNIX_EPOCH);
        let ctl = KillSwitchControl::new(store.clone(), Some(path.clone()), None);
        let t = |s| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let out = ctl.set(true, Some("drill".into()), t(10)).await;
        assert!(out.persisted);
        assert_eq!(out.version, 2);
        assert_eq!(store.current().kill_switch.since, Some(t(10)));
        let out = ctl.set(true, Some("still drilling".into()), t(20)).await;
        assert_eq!(out.kill_switch.since, Some(t(10)), "still on since 10");
        assert_eq!(
            load_kill_switch(&path).unwrap().reason.as_deref(),
            Some("still drilling")
        );
        let out = ctl.set(false, None, t(30)).await;
        assert_eq!(out.kill_switch.since, Some(t(30)));
        assert!(!load_kill_switch(&path).unwrap().active);

        let no_file = KillSwitchControl::new(StateStore::new(t(0)), None, None);
        let out = no_file.set(true, None, t(1)).await;
        assert!(!out.persisted);
        assert!(out.warning.is_some());
    }
}
