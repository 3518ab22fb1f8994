// Package proc runs OS processes for the lab and the tests (control-plane
// components, sidecars, kubelets, driver processes): each with its log file
// in one directory, stopped in reverse start order, and open to the lab's
// faults (kill and restart, pause and resume). Build compiles the binaries
// they run from this checkout.
package proc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"k8s.io/klog/v2"
)

// Spec is one process to run.
type Spec struct {
	// Name is unique in a Group; the log is <LogDir>/<Name>.log.
	Name string
	Path string
	Args []string
	// Env is added to the lab's own environment.
	Env []string
	// Restart starts the process again when it exits on its own (not after
	// Stop), after RestartDelay.
	Restart      bool
	RestartDelay time.Duration
}

// Group owns a set of processes.
type Group struct {
	logDir string
	log    klog.Logger

	mu     sync.Mutex
	procs  []*Proc
	closed bool
}

// NewGroup makes a group whose logs go to logDir.
func NewGroup(ctx context.Context, logDir string) (*Group, error) {
	if err := os.MkdirAll(logDir, 0o750); err != nil {
		return nil, err
	}
	return &Group{logDir: logDir, log: klog.FromContext(ctx).WithName("proc")}, nil
}

// Proc is a running (or restarting) process.
type Proc struct {
	g    *Group
	spec Spec
	log  klog.Logger

	mu       sync.Mutex
	cmd      *exec.Cmd
	done     chan struct{} // closed when the current incarnation exits
	exitErr  error
	stopping bool
	starts   int
	exits    []string // why each incarnation ended, for the report
	stopped  chan struct{}
}

// Start runs spec.
func (g *Group) Start(spec Spec) (*Proc, error) {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil, errors.New("proc: group stopped")
	}
	for _, p := range g.procs {
		if p.spec.Name == spec.Name {
			g.mu.Unlock()
			return nil, fmt.Errorf("proc: %s already started", spec.Name)
		}
	}
	p := &Proc{g: g, spec: spec, log: g.log.WithValues("process", spec.Name), stopped: make(chan struct{})}
	g.procs = append(g.procs, p)
	g.mu.Unlock()
	if err := p.start(); err != nil {
		return nil, err
	}
	if spec.Restart {
		go p.supervise()
	}
	return p, nil
}

// LogPath is where spec name's output goes.
func (g *Group) LogPath(name string) string { return filepath.Join(g.logDir, name+".log") }

func (p *Proc) start() error {
	logf, err := os.OpenFile(p.g.LogPath(p.spec.Name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.spec.Path, p.spec.Args...)
	cmd.Env = append(os.Environ(), p.spec.Env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group (a signal to the lab's terminal does not reach
	// it: the lab stops it in order), and killed if the lab dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	p.mu.Lock()
	p.starts++
	n := p.starts
	p.mu.Unlock()
	fmt.Fprintf(logf, "==== %s start #%d: %s %q\n", time.Now().Format(time.RFC3339Nano), n, p.spec.Path, p.spec.Args)
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", p.spec.Name, err)
	}
	done := make(chan struct{})
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	go func() {
		err := cmd.Wait()
		fmt.Fprintf(logf, "==== %s exit: %v\n", time.Now().Format(time.RFC3339Nano), err)
		logf.Close()
		p.mu.Lock()
		p.exitErr = err
		why := "exited"
		if err != nil {
			why = err.Error()
		}
		p.exits = append(p.exits, why)
		p.mu.Unlock()
		close(done)
	}()
	return nil
}

func (p *Proc) supervise() {
	for {
		p.mu.Lock()
		done := p.done
		p.mu.Unlock()
		select {
		case <-done:
		case <-p.stopped:
			return
		}
		p.mu.Lock()
		stopping := p.stopping
		p.mu.Unlock()
		if stopping {
			return
		}
		p.log.Info("process exited, restarting", "err", p.exitErr)
		select {
		case <-time.After(p.spec.RestartDelay):
		case <-p.stopped:
			return
		}
		if err := p.start(); err != nil {
			p.log.Error(err, "restart failed")
			return
		}
	}
}

// Name is the spec's name.
func (p *Proc) Name() string { return p.spec.Name }

// Pid is the current incarnation's process ID.
func (p *Proc) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// Starts counts how often the process was started (1 + restarts).
func (p *Proc) Starts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.starts
}

// Exited reports whether the current incarnation has ended, and how.
func (p *Proc) Exited() (bool, error) {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	select {
	case <-done:
		p.mu.Lock()
		defer p.mu.Unlock()
		return true, p.exitErr
	default:
		return false, nil
	}
}

// Signal sends sig to the current incarnation's process group.
func (p *Proc) Signal(sig syscall.Signal) error {
	p.mu.Lock()
	cmd := p.cmd
	p.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return errors.New("proc: not running")
	}
	return syscall.Kill(-cmd.Process.Pid, sig)
}

// Kill sends SIGKILL and waits for the process to end; a process with
// Restart set is started again by its supervisor.
func (p *Proc) Kill() error {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if err := p.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	<-done
	return nil
}

// Stop ends the process for good: SIGTERM, then SIGKILL after grace.
func (p *Proc) Stop(grace time.Duration) {
	p.mu.Lock()
	if p.stopping {
		p.mu.Unlock()
		return
	}
	p.stopping = true
	close(p.stopped)
	done := p.done
	p.mu.Unlock()
	if done == nil {
		return
	}
	select {
	case <-done:
		return
	default:
	}
	// A paused process must run again to handle SIGTERM.
	_ = p.Signal(syscall.SIGCONT)
	_ = p.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(grace):
		_ = p.Signal(syscall.SIGKILL)
		<-done
	}
}

// Stop ends every process in reverse start order.
func (g *Group) Stop(grace time.Duration) {
	g.mu.Lock()
	g.closed = true
	procs := g.procs
	g.mu.Unlock()
	for i := len(procs) - 1; i >= 0; i-- {
		procs[i].Stop(grace)
	}
}

// Procs lists the group's processes in start order.
func (g *Group) Procs() []*Proc {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]*Proc(nil), g.procs...)
}

// Dead returns the first process without Restart that has exited while the
// group runs, or nil.
func (g *Group) Dead() error {
	for _, p := range g.Procs() {
		p.mu.Lock()
		stopping, restart := p.stopping, p.spec.Restart
		p.mu.Unlock()
		if stopping || restart {
			continue
		}
		if exited, err := p.Exited(); exited {
			return fmt.Errorf("%s exited: %v (log %s)", p.spec.Name, err, p.g.LogPath(p.spec.Name))
		}
	}
	return nil
}
