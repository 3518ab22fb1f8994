// Package hotplug serializes volume hotplug per KubeVirt VM.
//
// Every ControllerPublish/ControllerUnpublish becomes an intent for one
// (VM, volume) pair; the latest intent for a pair wins and every caller waiting
// on a superseded intent is answered. Intents are grouped per VM in a
// rate-limited workqueue keyed by VM name, so one worker at a time changes a
// VM, gathering every pending addition and removal into as few writes as the
// Backend allows. An intent completes only when the VM and VMI informers show
// it done, never because a write was accepted.
package hotplug

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Op is what an intent wants for its volume.
type Op int

const (
	// Attach wants the volume hot-plugged and Ready on the VM.
	Attach Op = iota
	// Detach wants the volume gone from the VM and its VMI.
	Detach
)

func (o Op) String() string {
	if o == Attach {
		return "attach"
	}
	return "detach"
}

// MarshalText writes an Op as its name.
func (o Op) MarshalText() ([]byte, error) { return []byte(o.String()), nil }

// UnmarshalText reads an Op from its name.
func (o *Op) UnmarshalText(b []byte) error {
	switch string(b) {
	case "attach":
		*o = Attach
	case "detach":
		*o = Detach
	default:
		return fmt.Errorf("unknown hotplug op %q", b)
	}
	return nil
}

// Change is one volume addition or removal handed to a Backend. The volume
// name, the claim name and the disk name are all the volume ID, as upstream.
type Change struct {
	Volume string
	Op     Op
}

// Result classifies what a Backend saw for one Change.
type Result int

const (
	// Applied: the host cluster accepted the change.
	Applied Result = iota
	// AlreadyDone: the host says the change is already in place (KubeVirt's
	// "already exists" on add, "does not exist" on remove).
	AlreadyDone
	// InFlight: an identical or opposite request is queued on the VM and still
	// being processed; wait for it to settle.
	InFlight
	// Conflict: an optimistic-concurrency check failed (409/422); retry after
	// a fresh read.
	Conflict
	// Rejected: the host refused this one volume (webhook denial, not
	// hotpluggable, bad claim); Err says why. Final for the intent.
	Rejected
	// VMGone: the VM does not exist.
	VMGone
	// Failed: any other error; the VM is retried with backoff.
	Failed
)

var resultNames = [...]string{"applied", "already_done", "in_flight", "conflict", "rejected", "vm_gone", "failed"}

func (r Result) String() string { return resultNames[r] }

// Outcome is a Backend's answer for one Change.
type Outcome struct {
	Result Result
	Err    error
}

// Backend writes hotplug changes to one VM. Implementations make one attempt
// per call, starting from a fresh (uncached) read, so that a Conflict can be
// retried simply by calling Apply again. Only the queue's workers call it.
type Backend interface {
	// Start returns once Apply may be called: at once for a backend that
	// knows the host's hotplug path, after asking the host for one that
	// detects it (again while the host does not answer, reporting each
	// failed attempt through progress). The queue calls it first in Run
	// and answers "not ready" until it returned.
	Start(ctx context.Context, progress func(reason string)) error
	// Name identifies the backend in logs and metrics, once Start returned.
	Name() string
	// Apply returns one Outcome per change, in order. Removals come first in
	// changes; a backend that issues one call per change keeps that order.
	Apply(ctx context.Context, vm string, changes []Change) []Outcome
	// Refusal reads from the VM's status a refusal of the VM's queued add
	// request for volume (KubeVirt's legacy path answers a webhook's denial
	// there, not to the writer), nil when there is none or it passes by
	// itself. vm may be nil.
	Refusal(vm *kubevirtv1.VirtualMachine, volume string) error
}

// Reader reads the host namespace's VMs and VMIs from the API server itself,
// bypassing the informers, for the two decisions a stale cache must never
// make: that a VM does not exist, and that no other VM holds a volume at the
// moment an exclusive attach is written. It also reads and writes the
// reservation an exclusive attach puts on its volume's host PVC, the fence
// between controller processes that cannot see each other's queues. Only
// the queue's workers call it.
type Reader interface {
	VMExists(ctx context.Context, vm string) (bool, error)
	// Claim reads a host PVC with its reservation from the API server;
	// Exists is false when it is gone (or being deleted).
	Claim(ctx context.Context, claim string) (HostClaim, error)
	// Reserve writes r (the zero Reservation removes it) on the PVC as
	// read in from, only if the PVC has not changed since: a conflict
	// (apierrors.IsConflict) says someone else wrote it first. It returns
	// the PVC as written.
	Reserve(ctx context.Context, from HostClaim, r Reservation) (HostClaim, error)
	ListVMs(ctx context.Context) ([]kubevirtv1.VirtualMachine, error)
	ListVMIs(ctx context.Context) ([]kubevirtv1.VirtualMachineInstance, error)
	// LiveLaunchers reads from the API server the virt-launcher pods of
	// the VM's VMI vmi whose containers may still run, by pod UID.
	LiveLaunchers(ctx context.Context, vm string, vmi types.UID) (map[types.UID]bool, error)
	// WakeVM makes KubeVirt's VM controller look at the VM now, with a
	// change of the VM that touches neither its spec nor its status.
	WakeVM(ctx context.Context, vm string, at time.Time) error
}

// HostClaim is a host PVC as the queue reads it right before an attach.
type HostClaim struct {
	Phase  corev1.PersistentVolumeClaimPhase
	Exists bool
	// Reserved is the PVC's reservation; the zero value: none.
	Reserved Reservation
	// Object is the PVC as read, which Reserve writes back with its
	// resourceVersion as the precondition. Nil when it does not exist.
	Object *corev1.PersistentVolumeClaim
	// Cached says it comes from a watch cache, not a read: it may be
	// stale, so it only ever seeds a Reserve, whose resourceVersion
	// precondition proves it current (or answers a conflict); it never
	// decides anything on its own.
	Cached bool
}

// ClaimCache is a watch cache of the host's PVCs. It spares the read before
// a reservation is written or released: the write carries the cached
// resourceVersion, so it succeeds only if the PVC is still as cached, which
// makes a successful write a fresher claim check than a read before it.
type ClaimCache interface {
	// CachedClaim returns the PVC as the cache holds it (Cached set), or
	// false when the cache cannot say (not synced, not seen).
	CachedClaim(claim string) (HostClaim, bool)
}

// Reservation says which VM an exclusive volume is being attached to: it
// is written on the host PVC, with a resourceVersion precondition, before
// the attach is written to KubeVirt, so that of two controller processes
// attaching the volume to different VMs at once exactly one goes ahead.
type Reservation struct {
	// VM the volume is reserved for.
	VM string
	// Holder is the controller process that wrote it (Config.Identity).
	Holder string
	// At is when it was written or last renewed, on the holder's clock.
	At time.Time
}

// IsZero reports a PVC without a reservation.
func (r Reservation) IsZero() bool { return r.VM == "" }

// ErrVMNotFound is what a VMNotFoundError matches (errors.Is): an attach to
// a VM that does not exist.
var ErrVMNotFound = errors.New("virtual machine not found")

// VMNotFoundError answers an attach to a VM the host API server says does
// not exist. It names the VM, the volume and the namespace because its text
// is all an operator sees (the VolumeAttachment's attachError): a bare "not
// found" does not tell a deleted VM from a node ID pointing at the wrong
// namespace.
type VMNotFoundError struct {
	VM, Volume, Namespace string
}

func (e *VMNotFoundError) Error() string {
	return fmt.Sprintf("VM %s of volume %s not found in host namespace %s", e.VM, e.Volume, e.Namespace)
}

// Is makes errors.Is(err, ErrVMNotFound) hold.
func (e *VMNotFoundError) Is(target error) bool { return target == ErrVMNotFound }

// ErrVMFull is what a VMFullError matches (errors.Is), and what the backends
// wrap KubeVirt's refusal of a VM with too many disks in.
var ErrVMFull = errors.New("the VM has as many disks as KubeVirt allows")

// VMFullError refuses an attach that would give a VM more disks than
// KubeVirt allows; nothing was written.
type VMFullError struct {
	Volume, VM string
	// Disks is how many disks the VM has or is getting; Limit the most it
	// may have.
	Disks, Limit int
}

func (e *VMFullError) Error() string {
	return fmt.Sprintf("volume %s cannot be attached to VM %s: the VM has %d disks and KubeVirt allows at most %d, its own disks included", e.Volume, e.VM, e.Disks, e.Limit)
}

// Is makes errors.Is(err, ErrVMFull) hold.
func (e *VMFullError) Is(target error) bool { return target == ErrVMFull }

// HeldError says an exclusive volume is attached, attaching or still
// detaching on another VM.
type HeldError struct {
	Volume, VM, State string
}

func (e *HeldError) Error() string {
	return fmt.Sprintf("volume %s is %s on VM %s", e.Volume, e.State, e.VM)
}

// SupersededError answers the callers of an intent that a newer, opposite
// intent for the same volume and VM replaced.
type SupersededError struct {
	Volume, VM string
	By         Op
}

func (e *SupersededError) Error() string {
	return fmt.Sprintf("%s of volume %s on VM %s was superseded by a %s request", e.By.opposite(), e.Volume, e.VM, e.By)
}

func (o Op) opposite() Op { return 1 - o }

// PassingRefusal is a host refusal of a queued add request (Backend.Refusal)
// that clears by itself: Harvester's validator refusing a claim that its
// cache still shows on another VM. While no other VM holds the volume as far
// as the informers and this process know, the request stays queued for
// KubeVirt's own retry instead of failing the volume; the error is the
// host's.
type PassingRefusal struct{ Err error }

func (e *PassingRefusal) Error() string { return e.Err.Error() }

func (e *PassingRefusal) Unwrap() error { return e.Err }

// RejectedError carries the host's final refusal of one volume change.
type RejectedError struct {
	Volume, VM string
	Op         Op
	Err        error
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("%s of volume %s on VM %s rejected: %v", e.Op, e.Volume, e.VM, e.Err)
}

func (e *RejectedError) Unwrap() error { return e.Err }

// ExpiredError answers the callers of a DetachBefore whose deadline passed
// before the detach was written; nothing of it reached the host.
type ExpiredError struct {
	Volume, VM string
	Deadline   time.Time
}

func (e *ExpiredError) Error() string {
	return fmt.Sprintf("detach of volume %s from VM %s dropped: its deadline %s passed before it was written",
		e.Volume, e.VM, e.Deadline.UTC().Format(time.RFC3339Nano))
}

// ClaimNotReadyError refuses to hot-plug a claim that is gone or not Bound:
// KubeVirt would put it into the VM's attachment pod anyway, the pod would
// never start, and no other new volume of that VM would get attached.
type ClaimNotReadyError struct {
	Volume, VM string
	// Phase is the claim's phase; empty when the claim does not exist.
	Phase corev1.PersistentVolumeClaimPhase
}

func (e *ClaimNotReadyError) Error() string {
	if e.Phase == "" {
		return fmt.Sprintf("volume %s cannot be attached to VM %s: its host PVC does not exist (or is being deleted)", e.Volume, e.VM)
	}
	return fmt.Sprintf("volume %s cannot be attached to VM %s yet: its host PVC is %s, not Bound", e.Volume, e.VM, e.Phase)
}

// StalledError answers a caller whose intent is still pending while the VM's
// last attempt at the host failed: the cause (a refused identity, a host API
// that does not answer) is what an operator must see, not only "in progress".
// Unwrap gives the host's error, so API status checks see through it.
type StalledError struct {
	Volume, VM string
	Op         Op
	Cause      error
	Since      time.Time
}

func (e *StalledError) Error() string {
	return fmt.Sprintf("%s of volume %s on VM %s is not done: the host refused or did not answer the last attempt (failing since %s): %v",
		e.Op, e.Volume, e.VM, e.Since.UTC().Format(time.RFC3339), e.Cause)
}

func (e *StalledError) Unwrap() error { return e.Cause }
