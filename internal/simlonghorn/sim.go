package simlonghorn

import (
	"context"
	"fmt"
	"math/rand"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/rest"
)

// Real timings. Longhorn's own constants are cited where they are code;
// the stage durations are the reference figures for Harvester with Longhorn
// (Longhorn issue 1058: about 10 s per volume attach, about 3 s detach).
const (
	// csi/controller_server.go:39-40 (longhorn-manager v1.10.1).
	realPublishTimeout = 90 * time.Second
	realPublishTick    = 2 * time.Second

	realAttach        = 10 * time.Second
	realDetach        = 3 * time.Second
	realMigrateEngine = 10 * time.Second
	// The kubernetes PV controller follows pod events through an informer
	// and a work queue. Nothing publishes how far behind that runs; one
	// second is an assumption for a lightly loaded manager.
	realWorkloadsLag = 1 * time.Second
)

// Options tune the stand-in.
type Options struct {
	// Namespace holds the Longhorn objects (longhorn-system on Harvester).
	Namespace string
	// Scale multiplies every real duration (1 = real time, 0.01 for tests).
	Scale float64
	// Jitter spreads each stage duration uniformly by ±Jitter of itself.
	Jitter float64
	// Seed seeds the jitter.
	Seed int64
	// WorkloadsLag is how long (real time, scaled) the workloads list takes
	// to follow a pod change; 0 is one second.
	WorkloadsLag time.Duration
	// Faults are the faults on from the start.
	Faults Faults
	// DeviceDir holds the files behind the volumes' devices on each node
	// (loop devices, which need root), which NodePublish bind-mounts onto
	// a block volume's target as Longhorn does /dev/longhorn/<volume>.
	// Empty: the node service makes Longhorn's checks only and leaves
	// targets alone, for callers with no kubelet behind them.
	DeviceDir string
	// Devices, when set, hears of volumes' devices leaving host nodes and
	// coming back (DeviceHook).
	Devices DeviceHook
}

// Faults the stand-in can model.
type Faults struct {
	// SlowDetach multiplies the detach stage (a host teardown that drags);
	// 0 or 1 is the normal speed.
	SlowDetach float64
	// GhostWorkloads keeps one extra entry per volume in
	// status.kubernetesStatus.workloadsStatus that no pod backs, as Harvester
	// issue 9761 reports of pods long gone; while it is there the list does
	// not follow the pods (followWorkloads says why).
	GhostWorkloads map[string]WorkloadStatus
	// Faulted makes volumes faulted for a while (real time, scaled) from
	// New on, as Sim.FaultVolume does later.
	Faulted map[string]time.Duration
}

// Sim is the Longhorn stand-in: a longhorn-manager-like controller loop on
// the host API server and the CSI services of driver.longhorn.io.
type Sim struct {
	opts  Options
	store *store
	kube  kubernetes.Interface

	mu      sync.Mutex
	rng     *rand.Rand
	stages  map[string]*stage    // by volume: the stage under way
	faulted map[string]time.Time // by volume: faulted until
	lag     map[string]*lagging  // by volume: the workloads list on its way
	ghosts  map[string]WorkloadStatus
	view    *view // the informers, once Run has started them

	// slowDetach is Faults.SlowDetach, changed by SetSlowDetach while the
	// stand-in runs.
	slowDetach float64
	// cleared are the ghost entries taken away, by volume: the list kept
	// while no pod uses the volume must lose them too.
	cleared map[string]WorkloadStatus
}

// stage is a timed transition of a volume's engine.
type stage struct {
	kind   string // attach, detach, migrate, unmigrate
	node   string
	doneAt time.Time
}

// lagging is a workloads list the PV controller has computed but not yet
// written.
type lagging struct {
	list    []WorkloadStatus
	writeAt time.Time
}

// New returns a stand-in on the API server cfg reaches; Run starts it.
func New(cfg *rest.Config, opts Options) (*Sim, error) {
	if opts.Namespace == "" {
		opts.Namespace = "longhorn-system"
	}
	if opts.Scale <= 0 {
		return nil, fmt.Errorf("simlonghorn: Options.Scale must be positive, got %v", opts.Scale)
	}
	if opts.Jitter < 0 || opts.Jitter >= 1 {
		return nil, fmt.Errorf("simlonghorn: Options.Jitter must be in [0,1), got %v", opts.Jitter)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	ghosts := map[string]WorkloadStatus{}
	for k, v := range opts.Faults.GhostWorkloads {
		ghosts[k] = v
	}
	faulted := map[string]time.Time{}
	for name, d := range opts.Faults.Faulted {
		faulted[name] = time.Now().Add(time.Duration(float64(d) * opts.Scale))
	}
	return &Sim{
		opts:    opts,
		store:   &store{dyn: dyn, ns: opts.Namespace},
		kube:    kube,
		rng:     rand.New(rand.NewSource(opts.Seed)), //nolint:gosec // jitter, not security
		stages:  map[string]*stage{},
		faulted: faulted,
		lag:     map[string]*lagging{},
		ghosts:  ghosts,

		slowDetach: opts.Faults.SlowDetach,
		cleared:    map[string]WorkloadStatus{},
	}, nil
}

// scaled is d at the simulator's scale, without jitter (Longhorn's fixed
// timeouts and ticks).
func (s *Sim) scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) * s.opts.Scale)
}

// NewVolume describes a volume for CreateVolume.
type NewVolume struct {
	Name       string
	Size       int64
	Migratable bool
	// PVName, PVCNamespace and PVCName tie the volume to its Kubernetes
	// objects, as longhorn-manager's PV controller records them.
	PVName, PVCNamespace, PVCName string
}

// CreateVolume creates a detached, healthy Longhorn volume and its
// VolumeAttachment, as longhorn-manager does once the provisioner asked.
// A migratable volume is RWX, as only those migrate (longhorn-manager v1.10.1
// util/volume.go:14-16).
func (s *Sim) CreateVolume(ctx context.Context, spec NewVolume) error {
	if spec.Name == "" || spec.Size <= 0 {
		return fmt.Errorf("simlonghorn: volume needs a name and a positive size")
	}
	mode := AccessModeReadWriteOnce
	if spec.Migratable {
		mode = AccessModeReadWriteMany
	}
	v := &Volume{
		ObjectMeta: metav1.ObjectMeta{Name: spec.Name, Namespace: s.opts.Namespace},
		Spec: VolumeSpec{
			Size: spec.Size, Frontend: "blockdev", AccessMode: mode, Migratable: spec.Migratable, NumberOfReplicas: 3,
		},
	}
	created, err := s.store.createVolume(ctx, v)
	if err != nil {
		return err
	}
	old := clone(created)
	created.Status = VolumeStatus{
		State: VolumeStateDetached, Robustness: VolumeRobustnessUnknown,
		KubernetesStatus: KubernetesStatus{PVName: spec.PVName, Namespace: spec.PVCNamespace, PVCName: spec.PVCName},
	}
	if _, err := s.store.updateVolume(ctx, old, created); err != nil {
		return err
	}
	va := &VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: spec.Name, Namespace: s.opts.Namespace},
		Spec:       VolumeAttachmentSpec{Volume: spec.Name, AttachmentTickets: map[string]*AttachmentTicket{}},
	}
	if err := s.store.createVA(ctx, va); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// FaultVolume makes a volume faulted for d (real time, scaled here): its
// engine stops, Longhorn detaches it and attaches nothing until it recovers.
func (s *Sim) FaultVolume(volume string, d time.Duration) {
	s.FaultVolumeUntil(volume, time.Now().Add(s.scaled(d)))
}

// FaultVolumeUntil makes a volume faulted until a wall-clock time: for
// callers (the lab's faults) whose schedule is not in the stand-in's
// scaled time.
func (s *Sim) FaultVolumeUntil(volume string, until time.Time) {
	s.mu.Lock()
	s.faulted[volume] = until
	s.mu.Unlock()
	s.queue(volume)
}

// SetSlowDetach sets Faults.SlowDetach while the stand-in runs: detach
// stages that start afterwards take factor times as long (0 or 1: the
// normal speed). A stage under way keeps its end.
func (s *Sim) SetSlowDetach(factor float64) {
	s.mu.Lock()
	s.slowDetach = factor
	s.mu.Unlock()
}

// SetGhostWorkload adds (or, with an empty PodName, removes) a ghost entry
// of a volume's workloads list.
func (s *Sim) SetGhostWorkload(volume string, w WorkloadStatus) {
	s.mu.Lock()
	if w.PodName == "" {
		if old, ok := s.ghosts[volume]; ok {
			s.cleared[volume] = old
		}
		delete(s.ghosts, volume)
	} else {
		s.ghosts[volume] = w
		delete(s.cleared, volume)
	}
	s.mu.Unlock()
	s.queue(volume)
}

func (s *Sim) isFaulted(volume string, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return now.Before(s.faulted[volume])
}

// pass is what one reconcile pass reads, from the informers (watch.go):
// the volume's VolumeAttachment and, per namespace asked for, its pods.
// Optimistic concurrency (resourceVersion) turns a stale read into a
// conflict that the next pass redoes.
type pass struct {
	vas    map[string]*VolumeAttachment
	pods   map[string][]corev1.Pod
	lister corelisters.PodLister
}

// reconcile is one pass of longhorn-manager's controllers over a volume:
// the VolumeAttachment controller decides spec.nodeID and
// spec.migrationNodeID from the tickets, the volume controller moves the
// engine through timed stages, the PV controller follows the pods.
func (s *Sim) reconcile(ctx context.Context, p *pass, v *Volume) error {
	va := p.vas[v.Name]
	if va == nil {
		return nil // CreateVolume writes it right after the volume
	}
	oldV, oldVA := clone(v), clone(va)
	now := time.Now()
	s.progressVolume(ctx, v, now)
	decideAttachment(ctx, va, v)
	updateTicketStatuses(va, v)
	if err := s.followWorkloads(ctx, p, v, now); err != nil {
		return err
	}
	if _, err := s.store.updateVolume(ctx, oldV, v); err != nil {
		return err
	}
	s.tellDevices(ctx, p, oldV, v)
	return s.store.updateVA(ctx, oldVA, va)
}

// followWorkloads is longhorn-manager v1.10.1 controller/kubernetes_pv_controller.go
// setWorkloads (:460-480) behind a lag: the list becomes the pods that use
// the volume's PVC, each with its phase; with no such pod the old list stays
// and only lastPodRefAt is set. A ghost entry, when set, is there and the
// list does not follow the pods: setWorkloads replaces the whole list
// whenever a pod uses the claim (:469-478), so a ghost outlives its pod only
// while the PV controller has not synced the volume, and a list that held
// it next to freshly listed pods would be one Longhorn never writes (and a
// ghost no new attachment pod ever met).
func (s *Sim) followWorkloads(ctx context.Context, p *pass, v *Volume, now time.Time) error {
	ks := &v.Status.KubernetesStatus
	if ks.PVCName == "" {
		return nil
	}
	s.mu.Lock()
	ghost, hasGhost := s.ghosts[v.Name]
	cleared, wasCleared := s.cleared[v.Name]
	s.mu.Unlock()
	want := withoutGhost(withoutGhost(ks.WorkloadsStatus, ghost, hasGhost), cleared, wasCleared)
	if hasGhost {
		want = append(want, ghost)
	} else {
		var err error
		if want, err = s.podWorkloads(p, ks, want, now); err != nil {
			return err
		}
	}
	if jsonEqual(want, ks.WorkloadsStatus) {
		s.mu.Lock()
		delete(s.lag, v.Name)
		s.mu.Unlock()
		return nil
	}
	s.mu.Lock()
	// The lag runs from the first change not yet written: later changes
	// ride along, as events queued behind one another do, instead of
	// restarting it.
	l := s.lag[v.Name]
	if l == nil {
		l = &lagging{writeAt: now.Add(s.jitteredLocked(s.workloadsLag()))}
		s.lag[v.Name] = l
	}
	l.list = want
	due := !now.Before(l.writeAt)
	if due {
		delete(s.lag, v.Name)
	}
	s.mu.Unlock()
	if due {
		ks.WorkloadsStatus = want
	}
	return nil
}

// podWorkloads is the list setWorkloads writes: the pods that use the
// claim, or kept (the old list without taken-away ghosts) with lastPodRefAt
// set when none does.
func (s *Sim) podWorkloads(p *pass, ks *KubernetesStatus, kept []WorkloadStatus, now time.Time) ([]WorkloadStatus, error) {
	pods, err := p.podsOf(ks.Namespace)
	if err != nil {
		return nil, err
	}
	var want []WorkloadStatus
	for i := range pods {
		pod := &pods[i]
		if usesClaim(pod, ks.PVCName) {
			w := WorkloadStatus{PodName: pod.Name, PodStatus: string(pod.Status.Phase)}
			if len(pod.OwnerReferences) > 0 {
				w.WorkloadName, w.WorkloadType = pod.OwnerReferences[0].Name, pod.OwnerReferences[0].Kind
			}
			want = append(want, w)
		}
	}
	if len(want) == 0 {
		if len(kept) != 0 && ks.LastPodRefAt == "" {
			ks.LastPodRefAt = now.UTC().Format(time.RFC3339)
		}
		return kept, nil
	}
	ks.LastPodRefAt = ""
	return want, nil
}

func (s *Sim) workloadsLag() time.Duration {
	if s.opts.WorkloadsLag > 0 {
		return s.opts.WorkloadsLag
	}
	return realWorkloadsLag
}

// jitteredLocked is a stage duration at scale, spread by Options.Jitter;
// s.mu must be held (it guards the random source).
func (s *Sim) jitteredLocked(d time.Duration) time.Duration {
	f := 1 + s.opts.Jitter*(2*s.rng.Float64()-1)
	return time.Duration(float64(s.scaled(d)) * f)
}

func withoutGhost(list []WorkloadStatus, ghost WorkloadStatus, hasGhost bool) []WorkloadStatus {
	var out []WorkloadStatus
	for _, w := range list {
		if hasGhost && w == ghost {
			continue
		}
		out = append(out, w)
	}
	return out
}

func usesClaim(p *corev1.Pod, claim string) bool {
	for _, vol := range p.Spec.Volumes {
		if vol.PersistentVolumeClaim != nil && vol.PersistentVolumeClaim.ClaimName == claim {
			return true
		}
	}
	return false
}

// Volumes lists the Longhorn volumes from the API server.
func (s *Sim) Volumes(ctx context.Context) ([]*Volume, error) {
	return s.store.listVolumes(ctx)
}

// VolumeAttachments lists the Longhorn VolumeAttachments from the API
// server.
func (s *Sim) VolumeAttachments(ctx context.Context) ([]*VolumeAttachment, error) {
	return s.store.listVAs(ctx)
}

// Volume reads a Longhorn volume from the API server.
func (s *Sim) Volume(ctx context.Context, name string) (*Volume, error) {
	return s.store.getVolume(ctx, name)
}

// VolumeAttachment reads a Longhorn volume's VolumeAttachment (named as the
// volume) from the API server.
func (s *Sim) VolumeAttachment(ctx context.Context, volume string) (*VolumeAttachment, error) {
	return s.store.getVA(ctx, volume)
}
