//! A real nginx as a backend, on a free port, in its own temporary prefix (config, error
//! log, pid and temp folders there; nothing of the system's nginx is used), killed on
//! drop. For the tests where what matters is how a real server reads what the gateway
//! forwards (a `Host` it looks up a vhost by, a duplicated `Content-Length`).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

pub struct Nginx {
    pub port: u16,
    child: Child,
    dir: tempfile::TempDir,
}

impl Nginx {
    /// nginx serving the `server { ... }` blocks of `servers`, in which `LISTEN` stands for
    /// `127.0.0.1:<its port>`.
    ///
    /// Its port is picked free just before; if it was taken in between (nginx exits: "bind()
    /// ... Address already in use"), it starts again on another, as
    /// [`super::Gateway::start`] does. Any other failure panics with nginx's log.
    pub fn start(servers: &str) -> Nginx {
        let mut last = String::new();
        for _ in 0..5 {
            match Self::start_once(servers) {
                Ok(n) => return n,
                Err(e) if e.contains("Address already in use") => last = e,
                Err(e) => panic!("nginx did not start: {e}"),
            }
        }
        panic!("nginx found its port taken five times in a row: {last}");
    }

    fn start_once(servers: &str) -> Result<Nginx, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let d = dir.path().display();
        let servers = servers.replace("LISTEN", &format!("127.0.0.1:{port}"));
        let conf = format!(
            "worker_processes 1;\nerror_log {d}/error.log;\npid {d}/nginx.pid;\n\
             events {{ worker_connections 256; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  \
             fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n{servers}\n}}\n"
        );
        let file = dir.path().join("nginx.conf");
        std::fs::write(&file, conf).expect("write nginx.conf");
        let mut child = Command::new("nginx")
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(&file)
            .args(["-g", "daemon off;"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr.log")).expect("a log file"))
            .spawn()
            .map_err(|e| format!("spawn nginx (is it installed? scripts/test installs it): {e}"))?;
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if let Ok(Some(status)) = child.try_wait() {
                let read =
                    |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap_or_default();
                let (log, stderr) = (read("error.log"), read("stderr.log"));
                return Err(format!("nginx exited {status}: {log}{stderr}"));
            }
            // Its pid file is written once its sockets are bound (a bare connect could
            // reach another process that took the port first).
            let pid = std::fs::read_to_string(dir.path().join("nginx.pid")).unwrap_or_default();
            if pid.trim() == child.id().to_string()
                && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            {
                return Ok(Nginx { port, child, dir });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        Err("nginx did not listen within 10 s".into())
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// What nginx logged (its complaints about requests it refused, at `info`).
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: the master stops its worker, then itself; a kill only if it does not.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
