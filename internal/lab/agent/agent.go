// Package agent is the work the lab's pods do on their real mounted volumes.
// The hollow kubelet runs it as the container's process (`hcsi-lab agent
// ROLE`), with the container's mounts' host paths in HCSI_MOUNTS.
//
//   - db: a database. At start it verifies every record on its volume
//     against the last record it acknowledged (a checksum chain, so a lost
//     or torn record breaks it), then appends a record every interval
//     (fsync'ed, then acknowledged) and publishes its record count for the
//     backups, until it is stopped.
//   - backup: a backup Job. It reads the database's latest record count,
//     verifies the backup file the previous run left on its volume, writes a
//     new backup file with its checksum, and ends.
//
// Every verification is reported as one JSON line (an Event) in the lab's
// results directory ($HCSI_LAB_RESULTS), so the lab's data checker sees
// each match and each mismatch with the volume, pod, node and both
// checksums.
package agent

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Event is one verification result.
type Event struct {
	Time      time.Time `json:"time"`
	Role      string    `json:"role"`
	Namespace string    `json:"namespace"`
	Pod       string    `json:"pod"`
	Node      string    `json:"node"`
	Volume    string    `json:"volume"`
	OK        bool      `json:"ok"`
	// Records is the number of records (db) or the record count the backup
	// holds (backup) that were checked.
	Records int `json:"records"`
	// Expected and Got are the two checksums compared.
	Expected string `json:"expected,omitempty"`
	Got      string `json:"got,omitempty"`
	Detail   string `json:"detail,omitempty"`
}

// Env is what the agent learns from its environment.
type Env struct {
	Mounts    map[string]string // container path -> host path
	Namespace string
	Pod       string
	Node      string
	Results   string // directory of the lab's result files
}

// EnvFromOS reads Env from the variables the hollow kubelet and the lab set.
func EnvFromOS() (Env, error) {
	e := Env{
		Namespace: os.Getenv("HCSI_POD_NAMESPACE"),
		Pod:       os.Getenv("HCSI_POD_NAME"),
		Node:      os.Getenv("HCSI_NODE_NAME"),
		Results:   os.Getenv("HCSI_LAB_RESULTS"),
	}
	if err := json.Unmarshal([]byte(os.Getenv("HCSI_MOUNTS")), &e.Mounts); err != nil {
		return e, fmt.Errorf("agent: HCSI_MOUNTS: %w", err)
	}
	if e.Results == "" {
		return e, errors.New("agent: HCSI_LAB_RESULTS is not set")
	}
	return e, nil
}

var csiVolume = regexp.MustCompile(`/kubernetes\.io~csi/([^/]+)/mount`)

// VolumeOf is the PV name in a kubelet CSI mount path.
func VolumeOf(hostPath string) string {
	if m := csiVolume.FindStringSubmatch(hostPath); m != nil {
		return m[1]
	}
	return hostPath
}

func (e Env) dir(containerPath string) (string, error) {
	p, ok := e.Mounts[containerPath]
	if !ok {
		return "", fmt.Errorf("agent: no mount at %s (mounts %v)", containerPath, e.Mounts)
	}
	return p, nil
}

func (e Env) report(ev Event) error {
	ev.Time = time.Now()
	ev.Namespace, ev.Pod, ev.Node = e.Namespace, e.Pod, e.Node
	data, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(e.Results, "events.jsonl"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = f.Write(append(data, '\n'))
	return err
}

// latestFile is where the database of namespace ns publishes its record
// count for backups (a host file standing for a network query).
func (e Env) latestFile() string { return filepath.Join(e.Results, "db-"+e.Namespace+".count") }

// told is how many records the namespace's database has acknowledged to
// others (latestFile; 0 before its first).
func (e Env) told() int {
	data, err := os.ReadFile(e.latestFile())
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	return n
}

const (
	dbLog   = "records.log"
	dbAck   = "records.ack"
	genesis = "genesis"
)

func chain(prev string, seq int) string {
	h := sha256.Sum256([]byte(prev + "/" + strconv.Itoa(seq)))
	return hex.EncodeToString(h[:12])
}

// RunDB runs the database on the volume at containerPath until ctx ends.
func RunDB(ctx context.Context, e Env, containerPath string, interval time.Duration) error {
	dir, err := e.dir(containerPath)
	if err != nil {
		return err
	}
	vol := VolumeOf(dir)
	n, last, ev := VerifyDB(dir, e.told())
	ev.Role, ev.Volume = "db", vol
	if err := e.report(ev); err != nil {
		return err
	}
	if !ev.OK {
		return fmt.Errorf("agent: data check failed on %s: %s", vol, ev.Detail)
	}
	// A record written after the last acknowledgement was never confirmed to
	// anyone: drop it and continue from the acknowledged one.
	if err := truncateAfter(filepath.Join(dir, dbLog), n); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(dir, dbLog), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := syncDir(dir); err != nil { // the log's directory entry is durable too
		return err
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		n++
		last = chain(last, n)
		if _, err := fmt.Fprintf(f, "%d %s\n", n, last); err != nil {
			return err
		}
		if err := f.Sync(); err != nil {
			return err
		}
		if err := writeAtomic(filepath.Join(dir, dbAck), fmt.Sprintf("%d %s\n", n, last)); err != nil {
			return err
		}
		if err := writeAtomic(e.latestFile(), strconv.Itoa(n)); err != nil {
			return err
		}
	}
}

// Acknowledged is the number of records the database in dir has
// acknowledged.
func Acknowledged(dir string) int {
	ack, err := os.ReadFile(filepath.Join(dir, dbAck))
	if err != nil {
		return 0
	}
	var n int
	_, _ = fmt.Sscanf(string(ack), "%d", &n)
	return n
}

// VerifyDB checks the record log in dir against its acknowledgement: every
// acknowledged record must be there, in order, with an intact chain, and the
// acknowledgement must cover the told records the database acknowledged to
// others. It returns the number of records and the last checksum to continue
// from.
func VerifyDB(dir string, told int) (int, string, Event) {
	ack, err := os.ReadFile(filepath.Join(dir, dbAck))
	if errors.Is(err, os.ErrNotExist) {
		if told > 0 {
			return 0, genesis, Event{OK: false, Records: 0, Detail: fmt.Sprintf("%d records acknowledged, the volume has no acknowledgement", told)}
		}
		if _, err := os.Stat(filepath.Join(dir, dbLog)); err == nil {
			// Stopped before its first acknowledgement: whatever the log
			// holds was never confirmed to anyone.
			return 0, genesis, Event{OK: true, Detail: "new database (a record log nothing was acknowledged from)"}
		}
		return 0, genesis, Event{OK: true, Detail: "new database"}
	}
	if err != nil {
		return 0, genesis, Event{OK: false, Detail: err.Error()}
	}
	var ackN int
	var ackSum string
	if _, err := fmt.Sscanf(string(ack), "%d %s", &ackN, &ackSum); err != nil {
		return 0, genesis, Event{OK: false, Detail: fmt.Sprintf("unreadable acknowledgement %q", ack)}
	}
	if ackN < told {
		// The volume went back to an older state: records confirmed to
		// others are gone with their acknowledgement.
		return 0, genesis, Event{OK: false, Records: ackN, Expected: ackSum, Detail: fmt.Sprintf("%d records acknowledged, the volume acknowledges %d", told, ackN)}
	}
	f, err := os.Open(filepath.Join(dir, dbLog))
	if err != nil {
		return 0, genesis, Event{OK: false, Records: ackN, Expected: ackSum, Detail: err.Error()}
	}
	defer f.Close()
	n, sum := 0, genesis
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var seq int
		var got string
		if _, err := fmt.Sscanf(sc.Text(), "%d %s", &seq, &got); err != nil {
			// A torn last line after the acknowledged ones is a write the
			// database never acknowledged: not a loss.
			if n >= ackN {
				break
			}
			return n, sum, Event{OK: false, Records: n, Expected: ackSum, Got: sum, Detail: fmt.Sprintf("record %d unreadable: %q", n+1, sc.Text())}
		}
		want := chain(sum, n+1)
		if seq != n+1 || got != want {
			if n >= ackN {
				break
			}
			return n, sum, Event{OK: false, Records: n, Expected: want, Got: got, Detail: fmt.Sprintf("record %d broken (seq %d)", n+1, seq)}
		}
		n, sum = seq, got
		if n == ackN {
			break
		}
	}
	if n < ackN || sum != ackSum {
		return n, sum, Event{OK: false, Records: n, Expected: ackSum, Got: sum, Detail: fmt.Sprintf("%d records acknowledged, %d found", ackN, n)}
	}
	return n, sum, Event{OK: true, Records: n, Expected: ackSum, Got: sum}
}

func truncateAfter(path string, n int) error {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	lines := strings.SplitAfter(string(data), "\n")
	if len(lines) <= n {
		return nil
	}
	keep := strings.Join(lines[:n], "")
	if len(keep) == len(data) {
		return nil
	}
	return os.Truncate(path, int64(len(keep)))
}

// writeAtomic replaces path with content durably, as a careful database
// does: write and fsync a temporary file, rename it, fsync the directory. A
// disk pulled at any moment leaves the old or the new content.
func writeAtomic(path, content string) error {
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	if _, err := io.WriteString(f, content); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return syncDir(filepath.Dir(path))
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// backupFile holds one backup: a header line "<records> <sha256 of the
// rest>" and the dump, replaced atomically so the pair never tears.
const backupFile = "backup.dat"

// backupContent is what a backup of n records holds (a stand-in for a dump).
func backupContent(ns string, n int) []byte {
	var b strings.Builder
	for i := range 64 {
		fmt.Fprintf(&b, "%s record-count %d block %d\n", ns, n, i)
	}
	return []byte(b.String())
}

func sum(data []byte) string {
	h := sha256.Sum256(data)
	return hex.EncodeToString(h[:])
}

// RunBackup does one backup run on the volume at containerPath, taking work
// time in all: it verifies the previous run's file, then writes a new one.
func RunBackup(ctx context.Context, e Env, containerPath string, work time.Duration) error {
	dir, err := e.dir(containerPath)
	if err != nil {
		return err
	}
	vol := VolumeOf(dir)
	ev := VerifyBackup(dir)
	ev.Role, ev.Volume = "backup", vol
	if err := e.report(ev); err != nil {
		return err
	}
	if !ev.OK {
		return fmt.Errorf("agent: backup check failed on %s: %s", vol, ev.Detail)
	}
	n := e.told()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(work):
	}
	data := backupContent(e.Namespace, n)
	return writeAtomic(filepath.Join(dir, backupFile), fmt.Sprintf("%d %s\n%s", n, sum(data), data))
}

// VerifyBackup checks the previous run's backup file against its checksum.
func VerifyBackup(dir string) Event {
	raw, err := os.ReadFile(filepath.Join(dir, backupFile))
	if errors.Is(err, os.ErrNotExist) {
		return Event{OK: true, Detail: "first backup"}
	}
	if err != nil {
		return Event{OK: false, Detail: err.Error()}
	}
	header, data, ok := strings.Cut(string(raw), "\n")
	var n int
	var want string
	if _, err := fmt.Sscanf(header, "%d %s", &n, &want); err != nil || !ok {
		return Event{OK: false, Detail: fmt.Sprintf("unreadable backup header %q", header)}
	}
	got := sum([]byte(data))
	if got != want {
		return Event{OK: false, Records: n, Expected: want, Got: got, Detail: "backup file does not match its checksum"}
	}
	return Event{OK: true, Records: n, Expected: want, Got: got}
}

// ReadEvents reads the results directory's events.
func ReadEvents(results string) ([]Event, error) {
	f, err := os.Open(filepath.Join(results, "events.jsonl"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []Event
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var ev Event
		if json.Unmarshal(sc.Bytes(), &ev) == nil {
			out = append(out, ev)
		}
	}
	return out, sc.Err()
}
