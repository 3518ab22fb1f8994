package kubevirtsim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/harvester-csi/harvester-csi-driver/internal/virthandler"
)

// Mode selects which hotplug machinery the simulated KubeVirt runs. It only
// decides the feature gates written to the KubeVirt CR at Install; at run
// time the simulator follows the gates in the CR (legacy wins when both are
// listed), as KubeVirt does.
type Mode string

const (
	// ModeLegacy lists the HotplugVolumes gate: addvolume/removevolume queue
	// requests in vm.status.volumeRequests for the legacy VM controller.
	ModeLegacy Mode = "legacy"
	// ModeDeclarative lists only DeclarativeHotplugVolumes (v1.6 and later):
	// clients edit the VM spec (or call the VM subresource, which does that).
	ModeDeclarative Mode = "declarative"
)

// DefaultStorageClass is the host storage class the provisioner binds when
// Options.StorageClass is empty (Harvester's default class).
const DefaultStorageClass = "longhorn"

// Feature gate names in the KubeVirt CR.
const (
	GateHotplugVolumes            = "HotplugVolumes"
	GateDeclarativeHotplugVolumes = "DeclarativeHotplugVolumes"
)

// DiskHook lets a test attach something real (a loop device, say) when the
// simulated virt-handler plugs a volume into the guest. vm is
// "namespace/name". Plug runs just before a volumeStatus entry turns Ready;
// an error keeps the entry in MountedToPod and Plug is retried at the next
// handler poll. Unplug runs when the volume is unmounted from the VM; an
// error is retried the same way.
type DiskHook interface {
	Plug(ctx context.Context, vm, volume, claimName string) error
	Unplug(ctx context.Context, vm, volume string) error
}

// SnapshotHook lets a DiskHook keep real data across volume snapshots; the
// simulator uses it when Options.DiskHook also implements it. snapshot is the
// VolumeSnapshot's "namespace/name" and claimName a host PVC name, as Plug
// gets it. Snapshot runs before the VolumeSnapshot turns readyToUse, Restore
// before a PVC restoring from it is bound, DeleteSnapshot when the
// VolumeSnapshot is deleted (deletionPolicy Delete). An error is retried with
// backoff; Snapshot is not called again once the snapshot is ready, Restore
// may be (until the claim is bound) and DeleteSnapshot may be.
type SnapshotHook interface {
	Snapshot(ctx context.Context, claimName, snapshot string) error
	Restore(ctx context.Context, snapshot, claimName string) error
	DeleteSnapshot(ctx context.Context, snapshot string) error
}

// CloneHook lets a DiskHook copy a volume's data into its clone; the
// simulator uses it when Options.DiskHook also implements it. Clone runs
// before a PVC whose data source is another PVC is bound, and may run again
// until it is; sourceClaim and claimName are host PVC names, as Plug gets
// them. As Longhorn's clone, it copies a source that may be in use.
type CloneHook interface {
	Clone(ctx context.Context, sourceClaim, claimName string) error
}

// Timings are the simulated latencies (the package doc says where the
// defaults come from). A zero field takes the default shown; a
// negative field means "no delay". Every value is multiplied by
// Options.Scale.
type Timings struct {
	// API is virt-api's handling time before it reads the object (10ms).
	API time.Duration
	// RaceWindow is δ, the time between virt-api's GET and its compare-and-
	// swap patch (20ms). Wider windows give more 422s under concurrency.
	RaceWindow time.Duration
	// VMReconcile is the delay between a VM or VMI event and the VM
	// controller's pass (50ms).
	VMReconcile time.Duration
	// VMIReconcile is the delay between an event and the VMI controller's pass
	// (50ms).
	VMIReconcile time.Duration
	// PodStart, when set, is a flat time from creating an attachment pod to
	// its being Running and Ready, whatever it holds and wherever its
	// volumes are (unset: the staged model below; negative: at once).
	PodStart time.Duration
	// PodStartAttached is an attachment pod's start when every volume it
	// mounts is already attached on its host node, as when KubeVirt
	// replaces the pod on a volume-set change and the old one still holds
	// them (2.5s: schedule, sandbox, cached virt-launcher image, PLEG
	// relist; ~1.5-4 s on Harvester).
	PodStartAttached time.Duration
	// PodStartFresh is an attachment pod's start when at least one of its
	// volumes needs a Longhorn attach on that host node (10s; ~5-20 s
	// idle on Harvester, longhorn issue 1058 measured ~10 s per re-attach).
	PodStartFresh time.Duration
	// HostRelease is how long a host node still holds a volume after the
	// last running attachment pod mounting it is gone (3s: the host
	// kubelet's teardown and Longhorn's detach, ~3 s in longhorn issue
	// 1058); a pod started within it finds the volume attached.
	HostRelease time.Duration
	// PodCreateCrowd is the creation cost an attachment pod pays per
	// square of its volumes past PodCreateKnee (30ms; see
	// podStartDelay for where the curve comes from).
	PodCreateCrowd time.Duration
	// Mount is virt-handler's mount into virt-launcher, from an entry naming
	// a pod that holds the volume to its device in virt-launcher, then
	// MountedToPod (100ms: a mknod; internal/virthandler Timings.Mount).
	Mount time.Duration
	// DomainAttach is the time from MountedToPod to the domain having the
	// disk, then Ready (1.5s, ~1-2 s with Jitter).
	DomainAttach time.Duration
	// Detach is the time from a volume leaving the VMI spec to the domain
	// letting its disk go; virt-handler unmounts it in the same pass, then
	// UnMountedFromPod (500ms, ~0.2-1 s with Jitter). The guest loses the
	// disk at its end.
	Detach time.Duration
	// PodDelete is the time an attachment pod deleted with a grace period
	// spends terminating (1s). KubeVirt deletes its own with grace period 0
	// (v1.7.0 volume-hotplug.go:352, and the pod template's is 0 too), so
	// the API server drops them at once.
	PodDelete time.Duration
	// HandlerPoll is virt-handler's requeue period while a target is empty or
	// a disk hook failed (1s).
	HandlerPoll time.Duration
	// Bind is the time the host provisioner takes to bind a PVC (100ms).
	Bind time.Duration
	// Snapshot is the time the snapshot controller and Longhorn take from a
	// VolumeSnapshot whose source claim is bound to its being readyToUse
	// (1s).
	Snapshot time.Duration
	// Backup is the upload of a VolumeRemoteBackup's snapshot to the backup
	// target, from the snapshot being ready to the backup's success (2s).
	Backup time.Duration
	// Restore is the download of a VolumeRemoteRestore, from its creation
	// to its snapshot being ready for the restored PVC (2s).
	Restore time.Duration
	// NetworkFS is the time networkfs-manager takes to enable or disable an
	// NFS export (Enabling → Enabled, Disabling → Disabled) (2s).
	NetworkFS time.Duration
	// BackoffBase and BackoffMax bound the per-object exponential backoff
	// of a failed pass of the VM and VMI controllers and of virt-handler
	// (5ms, 1000s: client-go's default controller rate limiter, which each
	// of them uses, kubevirt v1.5.3 pkg/virt-controller/watch/vmi/vmi.go:91-93,
	// v1.7.0 pkg/virt-controller/watch/vmi/vmi.go:79-81). An informer event
	// requeues the object at once, whatever its backoff.
	BackoffBase time.Duration
	BackoffMax  time.Duration

	// podStartFlat records that the caller set PodStart, which then
	// replaces the staged model.
	podStartFlat bool
}

// DefaultTimings returns the unscaled defaults.
func DefaultTimings() Timings {
	return Timings{
		API:              10 * time.Millisecond,
		RaceWindow:       20 * time.Millisecond,
		VMReconcile:      50 * time.Millisecond,
		VMIReconcile:     50 * time.Millisecond,
		PodStartAttached: 2500 * time.Millisecond,
		PodStartFresh:    10 * time.Second,
		HostRelease:      3 * time.Second,
		PodCreateCrowd:   30 * time.Millisecond,
		Mount:            100 * time.Millisecond,
		DomainAttach:     1500 * time.Millisecond,
		Detach:           500 * time.Millisecond,
		PodDelete:        time.Second,
		HandlerPoll:      time.Second,
		Bind:             100 * time.Millisecond,
		Snapshot:         time.Second,
		Backup:           2 * time.Second,
		Restore:          2 * time.Second,
		NetworkFS:        2 * time.Second,
		BackoffBase:      5 * time.Millisecond,
		BackoffMax:       1000 * time.Second,
	}
}

// Options configure a Sim. The zero value is a legacy KubeVirt v1.7.0
// simulator with default timings over every namespace.
type Options struct {
	// Version is the KubeVirt release to reproduce (default V1_7_0).
	Version Version
	// Mode is the hotplug mode (default ModeLegacy); ModeDeclarative needs
	// v1.6 or later.
	Mode Mode
	// FeatureGates, when non-nil, replaces the gates derived from Mode in
	// the KubeVirt CR (an empty non-nil slice enables no hotplug gate).
	FeatureGates []string

	// Namespace limits the simulator to one namespace (VMs, VMIs, pods,
	// PVCs, webhooks). Empty means every namespace.
	Namespace string
	// KubeVirtNamespace and KubeVirtName locate the KubeVirt CR
	// (default "harvester-system"/"kubevirt").
	KubeVirtNamespace string
	KubeVirtName      string
	// ServerVersion is the Harvester server-version setting. Empty derives
	// it from the version: the Harvester release that ships it (v1.5.3:
	// v1.6.0, v1.6.3: v1.7.0, v1.7.0: v1.8.0, later: v1.9.0).
	ServerVersion string
	// SkipServerVersion leaves the server-version setting alone.
	SkipServerVersion bool

	// StorageClass is the host class the provisioner binds (default
	// "longhorn"); BindClasslessPVCs also binds PVCs with no class.
	StorageClass      string
	BindClasslessPVCs bool
	// NodeName is the node VMIs run on (default "harvester-node-0"); not
	// with Kubelets, where the scheduler picks it.
	NodeName string
	// Kubelets says real kubelets run the host nodes, with a real
	// scheduler and attach/detach controller (internal/simhost's host
	// storage): each VMI gets a virt-launcher pod, and its attachment pods
	// carry KubeVirt's node affinity to that pod's node instead of a node
	// name (launcher.go); the simulator's kubelet stands aside; virt-handler
	// finds a device in an attachment pod only once the host kubelet
	// published it (podview.HandlerPod, the rule of the real control
	// plane's node agents).
	Kubelets bool
	// ProvisionHook, when set, runs before the provisioner creates the PV of
	// a claim it binds, as Longhorn's CreateVolume makes its volume before
	// external-provisioner writes the PV; an error leaves the claim Pending,
	// retried.
	ProvisionHook func(ctx context.Context, pvc *corev1.PersistentVolumeClaim, pvName string, size resource.Quantity) error
	// NFSEndpoint is the address an enabled NetworkFilesystem reports
	// (default DefaultNFSEndpoint); NFSMountOptions its recommended mount
	// options (default none).
	NFSEndpoint     string
	NFSMountOptions string

	// DiskHook is called around guest plug and unplug; nil is a no-op. If it
	// also implements SnapshotHook, it is called around volume snapshots,
	// and if it implements CloneHook, before a clone is bound.
	DiskHook DiskHook

	// Timings are the simulated latencies; Scale multiplies all of them, and
	// a VMI's termination grace period too (0 means 1; tests use e.g. 0.05).
	Timings Timings
	Scale   float64
	// Jitter spreads every delay uniformly over ±Jitter of its value
	// (0 = exact, 0.25 = ±25%); Seed seeds the generator.
	Jitter float64
	Seed   uint64
}

func (o *Options) setDefaults() error {
	if o.Mode == "" {
		o.Mode = ModeLegacy
	}
	if o.Version == "" {
		o.Version = V1_7_0
	}
	switch o.Mode {
	case ModeLegacy, ModeDeclarative:
	default:
		return fmt.Errorf("kubevirtsim: unknown mode %q", o.Mode)
	}
	if _, err := ParseVersion(string(o.Version)); err != nil {
		return err
	}
	if _, err := virthandler.ForVersion(string(o.Version)); err != nil {
		return err
	}
	if o.Mode == ModeDeclarative && !o.Version.features().declarativeGate {
		return fmt.Errorf("kubevirtsim: KubeVirt %s has no DeclarativeHotplugVolumes gate", o.Version)
	}
	if o.KubeVirtNamespace == "" {
		o.KubeVirtNamespace = "harvester-system"
	}
	if o.KubeVirtName == "" {
		o.KubeVirtName = "kubevirt"
	}
	if o.ServerVersion == "" {
		o.ServerVersion = o.Version.features().harvester
	}
	if o.StorageClass == "" {
		o.StorageClass = DefaultStorageClass
	}
	if o.NodeName == "" {
		o.NodeName = "harvester-node-0"
	}
	if o.Scale <= 0 {
		o.Scale = 1
	}
	if o.Jitter < 0 || o.Jitter >= 1 {
		return fmt.Errorf("kubevirtsim: jitter %v out of [0,1)", o.Jitter)
	}
	d := DefaultTimings()
	fill := func(v *time.Duration, def time.Duration) {
		switch {
		case *v == 0:
			*v = def
		case *v < 0:
			*v = 0
		}
		*v = time.Duration(float64(*v) * o.Scale)
	}
	t := &o.Timings
	fill(&t.API, d.API)
	fill(&t.RaceWindow, d.RaceWindow)
	fill(&t.VMReconcile, d.VMReconcile)
	fill(&t.VMIReconcile, d.VMIReconcile)
	t.podStartFlat = t.PodStart != 0
	if t.podStartFlat {
		fill(&t.PodStart, 0)
	}
	fill(&t.PodStartAttached, d.PodStartAttached)
	fill(&t.PodStartFresh, d.PodStartFresh)
	fill(&t.HostRelease, d.HostRelease)
	fill(&t.PodCreateCrowd, d.PodCreateCrowd)
	fill(&t.Mount, d.Mount)
	fill(&t.DomainAttach, d.DomainAttach)
	fill(&t.Detach, d.Detach)
	fill(&t.PodDelete, d.PodDelete)
	fill(&t.HandlerPoll, d.HandlerPoll)
	fill(&t.Bind, d.Bind)
	fill(&t.Snapshot, d.Snapshot)
	fill(&t.Backup, d.Backup)
	fill(&t.Restore, d.Restore)
	fill(&t.NetworkFS, d.NetworkFS)
	fill(&t.BackoffBase, d.BackoffBase)
	fill(&t.BackoffMax, d.BackoffMax)
	if t.HandlerPoll <= 0 {
		t.HandlerPoll = time.Millisecond
	}
	if t.BackoffBase <= 0 {
		t.BackoffBase = time.Microsecond
	}
	if t.BackoffMax < t.BackoffBase {
		t.BackoffMax = t.BackoffBase
	}
	return nil
}

// gates returns the feature gates Install writes.
func (o *Options) gates() []string {
	if o.FeatureGates != nil {
		return append([]string{}, o.FeatureGates...)
	}
	if o.Mode == ModeDeclarative {
		return []string{GateDeclarativeHotplugVolumes}
	}
	return []string{GateHotplugVolumes}
}

// jitterer draws jittered durations from a seeded generator.
type jitterer struct {
	mu  sync.Mutex
	r   *rand.Rand
	amt float64
}

func newJitterer(seed uint64, amount float64) *jitterer {
	return &jitterer{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), amt: amount}
}

func (j *jitterer) d(base time.Duration) time.Duration {
	if j.amt == 0 || base <= 0 {
		return base
	}
	j.mu.Lock()
	f := 1 + j.amt*(2*j.r.Float64()-1)
	j.mu.Unlock()
	return time.Duration(float64(base) * f)
}

func (j *jitterer) intn(n int) int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.r.IntN(n)
}
