package hotplug

import (
	"os"
	"time"
)

// Config tunes the queue. Zero fields take the defaults of DefaultConfig.
type Config struct {
	// Namespace of the VMs on the host cluster. Required.
	Namespace string
	// Workers is how many VMs are worked on at once.
	Workers int
	// BatchWindow is how long the first intent on an idle VM waits for more.
	BatchWindow time.Duration
	// MaxHold bounds how long a VM is left alone while KubeVirt settles the
	// previous change, and how long a write may go unobserved.
	MaxHold time.Duration
	// PodStartHold replaces MaxHold while KubeVirt waits for an attachment
	// pod it created to start (an entry names the pod but no UID yet): on a
	// Harvester host that is the scheduler, Longhorn's attach (up to 90 s
	// before the host's attacher retries) and the kubelet. A change written
	// meanwhile makes KubeVirt drop the pod and start over (kubevirt
	// 16937). Zero means five times MaxHold.
	PodStartHold time.Duration
	// JoinWindow lets adds that arrive shortly after a write join the
	// attachment pod KubeVirt is still starting for it, instead of waiting
	// for that pod's whole cycle and then their own: once per cycle, within
	// this long of the write, and only while nothing of the VM is mounted or
	// on its way out (joinable). Zero turns joining off.
	JoinWindow time.Duration
	// MaxConflictRetries bounds the immediate retries after a conflict before
	// the VM is requeued with backoff.
	MaxConflictRetries int
	// BackoffBase and BackoffMax bound the per-VM exponential backoff.
	BackoffBase, BackoffMax time.Duration
	// QPS and Burst form the token bucket shared by all VMs' retries.
	QPS   float64
	Burst int
	// RequestTimeout bounds one attempt at the host (a backend Apply, a live
	// read), so a host API that hangs surfaces as an error within seconds.
	RequestTimeout time.Duration
	// SlowAfter is how long an intent may wait for the same thing before the
	// queue says so in its log at the default level.
	SlowAfter time.Duration
	// WedgedAfter is how long an intent may wait on a step only KubeVirt
	// can take, with KubeVirt showing no progress on the volume or the VM's
	// hotplug set, before the queue reports the VM wedged (an Event, a
	// metric, the caller's answer). See DefaultWedgedAfter.
	WedgedAfter time.Duration
	// Identity names this controller process in the reservations it
	// writes on host PVCs. Two processes that run at once must not share
	// it; a restarted process that keeps it (the pod's name) goes on under
	// its predecessor's reservations instead of waiting for them to expire.
	Identity string
	// ReservationFresh is how old a reservation of this process may be
	// when an attach is written under it; an older one is renewed first.
	ReservationFresh time.Duration
	// ReservationTTL is when another VM may take over a reservation whose
	// VM does not hold the volume. It must cover the holder's whole
	// window for writing (ReservationFresh + RequestTimeout) plus the
	// clock difference between controller hosts; the default leaves 10s
	// for that.
	ReservationTTL time.Duration
	// MaxDisks is how many disks and volumes KubeVirt lets a VM have, its
	// own disks (root, cloud-init) included: an attach that would pass it
	// is answered ErrVMFull without a write (MaxVMDisks by default).
	MaxDisks int
	// Strategy orders and groups the writes to one VM around the bugs of
	// the KubeVirt release that runs. One without a Name is AutoStrategy:
	// turning rules off takes a named strategy, so a Config that never
	// mentions it does not lose them.
	Strategy Strategy
}

// DefaultWedgedAfter outlasts the slowest step of a hotplug on Harvester
// that still ends by itself, without a sign of progress in the VMI: the
// attachment pod's volume attach, where Longhorn's ControllerPublish waits
// up to 90 s for its attachment ticket (longhorn-manager v1.10.1
// csi/controller_server.go), followed by kubelet's retries of a refused
// NodePublish, whose backoff grows to 2m2s (kubernetes v1.35
// pkg/util/goroutinemap/exponentialbackoff, maxDurationBeforeRetry). Five minutes is that
// with room to spare; a wait this long with nothing moving is a KubeVirt
// state that needs an operator (docs/troubleshooting.md).
const DefaultWedgedAfter = 5 * time.Minute

// MaxVMDisks is KubeVirt's limit on a VM's disks and on its volumes: the
// CRDs' OpenAPI schemas say maxItems 256 for both lists (kubevirt v1.7.0
// staging/src/kubevirt.io/api/core/v1/schema.go:464 and types.go:128), so
// the API server refuses a VM or VMI with a 257th (harvester/harvester#11259).
const MaxVMDisks = 256

// DefaultConfig holds the defaults the command line uses.
func DefaultConfig() Config {
	return Config{
		Workers:            10,
		BatchWindow:        200 * time.Millisecond,
		MaxHold:            30 * time.Second,
		JoinWindow:         5 * time.Second,
		MaxConflictRetries: 5,
		BackoffBase:        200 * time.Millisecond,
		BackoffMax:         time.Minute,
		QPS:                10,
		Burst:              20,
		RequestTimeout:     15 * time.Second,
		SlowAfter:          time.Minute,
		WedgedAfter:        DefaultWedgedAfter,
		Identity:           defaultIdentity(),
		ReservationFresh:   5 * time.Second,
		MaxDisks:           MaxVMDisks,
		Strategy:           AutoStrategy(),
	}
}

// clockAllowance is what the default ReservationTTL adds to the holder's
// window for writing: the clocks of two controller hosts may disagree by
// that much (and an API server may still carry out a write for a moment
// after its client gave up on it).
const clockAllowance = 10 * time.Second

// defaultIdentity is the host name: a pod's name, which a container restart
// keeps and a rolling update or a second replica does not share.
func defaultIdentity() string {
	if h, err := os.Hostname(); err == nil && h != "" {
		return h
	}
	return "harvester-csi-driver"
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	orDefault(&c.Workers, d.Workers)
	orDefault(&c.BatchWindow, d.BatchWindow)
	orDefault(&c.MaxHold, d.MaxHold)
	orDefault(&c.PodStartHold, 5*c.MaxHold)
	orDefault(&c.MaxConflictRetries, d.MaxConflictRetries)
	orDefault(&c.BackoffBase, d.BackoffBase)
	orDefault(&c.BackoffMax, d.BackoffMax)
	orDefault(&c.QPS, d.QPS)
	orDefault(&c.Burst, d.Burst)
	orDefault(&c.RequestTimeout, d.RequestTimeout)
	orDefault(&c.SlowAfter, d.SlowAfter)
	orDefault(&c.WedgedAfter, d.WedgedAfter)
	orDefault(&c.ReservationFresh, d.ReservationFresh)
	orDefault(&c.MaxDisks, d.MaxDisks)
	orDefault(&c.ReservationTTL, c.ReservationFresh+c.RequestTimeout+clockAllowance)
	if c.Strategy.Name == "" {
		c.Strategy = d.Strategy
	}
	if c.Identity == "" {
		c.Identity = d.Identity
	}
	return c
}

func orDefault[T int | float64 | time.Duration](v *T, d T) {
	if *v <= 0 {
		*v = d
	}
}
