package kubevirtsim

// Live migration of a VMI to another host node, driven by a
// VirtualMachineInstanceMigration as Harvester creates one (its migrate
// action, and every VM in turn during an upgrade's node drain). What a
// hotplug sees of it, per kubevirt v1.7.0 (the same logic at v1.5.2, v1.6.3
// and v1.8.2 unless said):
//
//   - The migration controller walks Pending → Scheduling → Scheduled →
//     PreparingTarget → TargetReady → Running → Succeeded
//     (pkg/virt-controller/watch/migration/migration.go:692-825 processMigrationPhase). Once the
//     target virt-launcher pod is Ready it creates one attachment pod for
//     the VMI's hotplug volumes of that moment, on the target node
//     (:1641-1651 createAttachmentPod at :1383, rendered for the target pod
//     by RenderHotplugAttachmentPodTemplate, with required node affinity to
//     its node), and moves on to Scheduling and Scheduled only once that pod
//     is Ready too (:726-733, :769-779). At the hand-off it writes the VMI's
//     migrationState: source and target node, and the target attachment
//     pod's UID (:1177-1188).
//   - The source virt-handler stamps migrationState.startTimestamp when the
//     transfer starts; from then until endTimestamp KubeVirt counts the VMI
//     as migrating (pkg/util/migrations/migrations.go:76-97 IsMigrating).
//   - The target virt-handler acknowledges the end: endTimestamp, and
//     status.nodeName becomes the target node
//     (pkg/virt-handler/migration-target.go:193-211; v1.5.2
//     pkg/virt-handler/vm.go:701). From then the VMI controller's current
//     virt-launcher pod is the target's (pkg/controller/controller.go:321-357
//     CurrentVMIPod takes the pods of status.nodeName), so the target's
//     attachment pod is the one its hotplug handling and volumeStatus look
//     at: entries already Ready stay Ready and name that pod
//     (pkg/virt-controller/watch/vmi/storage.go:187-210).
//   - Legacy hotplug: every VM write that carries status.volumeRequests is
//     denied while the VMI is migrating, "Cannot handle volume requests
//     while VMI migration is in progress" (v1.7.0
//     pkg/virt-api/webhooks/validating-webhook/admitters/vms-admitter.go:449-455,
//     v1.5.2 :433-439; webhook.go here). Declarative hotplug writes the VM
//     spec without volumeRequests, which that check skips (:312-315), and
//     the VM controller patches the VMI whenever it runs
//     (pkg/storage/hotplug/hotplug.go:51-93): nothing guards it.
//   - virt-handler leaves a migrating VMI alone (pkg/virt-handler/vm.go:391-394,
//     controller.go:308-315 isMigrationInProgress): a volume added or
//     removed during the transfer is neither mounted nor unplugged until the
//     VMI is on the target node, where the VMI controller gives it a new
//     attachment pod holding the whole set.
//
// Without Options.Kubelets the simulator has no virt-launcher pods: the
// target's start is a delay, the VMI's attachment pods are those on
// status.nodeName (cluster.go attachmentPods, as CurrentVMIPod and
// AttachmentPods select them), and at the end the source node's attachment
// pods are deleted, as the source virt-launcher pod they belong to ends.
// With it (real kubelets on host nodes) the target virt-launcher pod is a
// real pod the host scheduler places and its attachment pod is owned by it
// (prepareTargetOnHost); at the end the source virt-launcher pod and its
// attachment pods are deleted, and the host's attach/detach and Longhorn
// let the source node go.

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

const resMigrations = "virtualmachineinstancemigrations"

// Migration timings, before Options.Scale. KubeVirt publishes none and the
// Harvester reference gives none: the target virt-launcher pod starts like
// an attachment pod whose image is cached (a few seconds), the target's
// preparation is one virt-handler pass, and the memory transfer of a small
// guest (a few GiB over a 10 GbE migration network, one or two
// pre-copy rounds) takes seconds.
const (
	migrationTargetStart = 3 * time.Second
	migrationPrepare     = 500 * time.Millisecond
	migrationTransfer    = 5 * time.Second
	// migrationUnschedulableTimeout is KubeVirt's
	// defaultUnschedulablePendingTimeoutSeconds (migration.go:82).
	migrationUnschedulableTimeout = 5 * time.Minute
)

// migrationController is virt-controller's migration controller with the
// source and target virt-handler's parts of a migration.
type migrationController struct {
	c     *cluster
	queue workQueue

	mu  sync.Mutex
	due deadlines // per migration key and step
	// held VMs keep transferring until released (Faults.HoldMigration): a
	// guest dirtying memory faster than the link copies it.
	held map[string]bool
	// created holds the target pods created and not yet seen in the cache,
	// per migration key, so a pass on a cache without one does not create
	// another (KubeVirt's pod expectations, migration.go:1415-1416).
	created map[string]time.Time
}

func newMigrationController(c *cluster) *migrationController {
	return &migrationController{
		c: c, queue: newWorkQueue("migration", c.t.BackoffBase, c.t.HandlerPoll),
		due: deadlines{}, held: map[string]bool{}, created: map[string]time.Time{},
	}
}

func (m *migrationController) register() {
	enqueue := func(key string) { m.queue.AddAfter(key, m.c.jit.d(m.c.t.VMIReconcile)) }
	_, _ = m.c.migInf.AddEventHandler(onEvent(func(obj any) { enqueue(objectKey(obj)) }))
	_, _ = m.c.podInf.AddEventHandler(onEvent(func(obj any) {
		if p, ok := unwrap(obj).(*corev1.Pod); ok && p.Annotations[kubevirtv1.MigrationJobNameAnnotation] != "" {
			enqueue(p.Namespace + "/" + p.Annotations[kubevirtv1.MigrationJobNameAnnotation])
		}
	}))
}

func (m *migrationController) run(ctx context.Context) { m.queue.run(ctx, m.c, 2, m.sync) }
func (m *migrationController) shutdown()               { m.queue.ShutDown() }

func (m *migrationController) hold(vmKey string, on bool) {
	m.mu.Lock()
	m.held[vmKey] = on
	m.mu.Unlock()
	m.c.eachMigrationOf(vmKey, func(key string) { m.queue.Add(key) })
}

func (m *migrationController) isHeld(vmKey string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.held[vmKey]
}

// wait returns how long until the step's deadline (0: it has come).
func (m *migrationController) wait(key, step string, d time.Duration) time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	d = time.Duration(float64(d) * m.c.opts.Scale)
	if at := m.due.at(key+"/"+step, now, d, m.c.jit); now.Before(at) {
		return at.Sub(now)
	}
	return 0
}

// sync is one pass over one migration: at most one phase step.
func (m *migrationController) sync(ctx context.Context, key string) (time.Duration, error) {
	obj, exists, _ := m.c.migInf.GetIndexer().GetByKey(key)
	if !exists {
		m.forget(key)
		return 0, nil
	}
	mig := obj.(*kubevirtv1.VirtualMachineInstanceMigration)
	if mig.IsFinal() {
		m.forget(key)
		return 0, nil
	}
	vmi, ok := m.c.cachedVMI(mig.Namespace + "/" + mig.Spec.VMIName)
	if !ok || vmi.DeletionTimestamp != nil || vmi.IsFinal() {
		return 0, m.fail(ctx, mig, vmi, "VMI is not running")
	}
	log := m.c.log.WithValues("vm", mig.Namespace+"/"+mig.Spec.VMIName, "migration", mig.Name)
	switch mig.Status.Phase {
	case kubevirtv1.MigrationPhaseUnset:
		if vmi.Status.Phase != kubevirtv1.Running {
			return m.c.t.HandlerPoll, nil // migration.go canMigrateVMI waits for a running VMI
		}
		if other := activeMigration(vmi); other != "" && other != mig.UID {
			// migration.go:716-722.
			return 0, m.fail(ctx, mig, vmi, "VMI is not eligible for migration because another migration job is in progress.")
		}
		return 0, m.setPhase(ctx, mig, kubevirtv1.MigrationPending)
	case kubevirtv1.MigrationPending:
		if m.c.opts.Kubelets {
			return m.prepareTargetOnHost(ctx, key, mig, vmi)
		}
		if d := m.wait(key, "target-pod", migrationTargetStart); d > 0 {
			return d, nil
		}
		if len(hotplugOf(vmi)) == 0 {
			return 0, m.setPhase(ctx, mig, kubevirtv1.MigrationScheduling)
		}
		return m.ensureTargetAttachmentPod(ctx, key, mig, vmi, nil)
	case kubevirtv1.MigrationScheduling:
		return 0, m.setPhase(ctx, mig, kubevirtv1.MigrationScheduled)
	case kubevirtv1.MigrationScheduled:
		if err := m.handOff(ctx, mig, vmi); err != nil {
			return 0, err
		}
		return 0, m.setPhase(ctx, mig, kubevirtv1.MigrationPreparingTarget)
	case kubevirtv1.MigrationPreparingTarget:
		if d := m.wait(key, "prepare", migrationPrepare); d > 0 {
			return d, nil
		}
		return 0, m.setPhase(ctx, mig, kubevirtv1.MigrationTargetReady)
	case kubevirtv1.MigrationTargetReady:
		if err := m.editVMI(ctx, vmi, func(st *kubevirtv1.VirtualMachineInstanceStatus) {
			st.MigrationState.StartTimestamp = ptr.To(metav1.Now())
		}); err != nil {
			return 0, err
		}
		log.V(2).Info("migration started", "from", vmi.Status.NodeName, "to", targetOf(vmi))
		return 0, m.setPhase(ctx, mig, kubevirtv1.MigrationRunning)
	case kubevirtv1.MigrationRunning:
		if d := m.wait(key, "transfer", migrationTransfer); d > 0 {
			return d, nil
		}
		if m.isHeld(mig.Namespace + "/" + mig.Spec.VMIName) {
			return 0, nil // hold's release requeues
		}
		if err := m.complete(ctx, vmi); err != nil {
			return 0, err
		}
		log.V(2).Info("migration completed", "node", targetOf(vmi))
		return 0, m.setPhase(ctx, mig, kubevirtv1.MigrationSucceeded)
	}
	return 0, nil
}

// ensureTargetAttachmentPod creates the target's attachment pod with the
// VMI's hotplug volumes, waits for it to be Ready and then moves the
// migration on to Scheduling (migration.go:1641-1655, :726-733). launcher
// is the target virt-launcher pod with Options.Kubelets, else nil.
func (m *migrationController) ensureTargetAttachmentPod(ctx context.Context, key string, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance, launcher *corev1.Pod) (time.Duration, error) {
	pod := m.targetPod(mig)
	if pod == nil {
		if m.awaitingPod(key) {
			return 10 * time.Millisecond, nil
		}
		p, err := m.createTargetPod(ctx, mig, vmi, launcher)
		if err != nil {
			return 0, fmt.Errorf("failed to create attachment pod: %w", err)
		}
		m.noteCreated(key)
		m.c.log.V(2).Info("target attachment pod created", "vm", mig.Namespace+"/"+mig.Spec.VMIName, "migration", mig.Name,
			"pod", p.Name, "node", p.Spec.NodeName, "volumes", podVolumes(p))
		return 0, nil
	}
	if !containerReady(pod) {
		return 0, nil // the pod's events bring the next pass
	}
	return 0, m.setPhase(ctx, mig, kubevirtv1.MigrationScheduling)
}

// prepareTargetOnHost is phase Pending with Options.Kubelets: KubeVirt's
// migration controller creates the target virt-launcher pod, which the
// host scheduler places off the source node and a host kubelet runs; once
// it is Ready, its attachment pod (migration.go:1620-1655). An
// unschedulable target pod ends the migration after KubeVirt's pending
// timeout (:82, :1428-1442), scaled.
func (m *migrationController) prepareTargetOnHost(ctx context.Context, key string, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance) (time.Duration, error) {
	launcher := m.targetLauncher(mig)
	if launcher == nil {
		if m.awaitingPod(key + "/launcher") {
			return 10 * time.Millisecond, nil
		}
		p, err := m.c.kube.CoreV1().Pods(vmi.Namespace).Create(ctx, targetLauncherManifest(mig, vmi), metav1.CreateOptions{})
		if err != nil {
			return 0, fmt.Errorf("failed to create target virt-launcher pod: %w", err)
		}
		m.noteCreated(key + "/launcher")
		m.c.log.V(2).Info("target virt-launcher pod created", "vm", mig.Namespace+"/"+mig.Spec.VMIName, "migration", mig.Name, "pod", p.Name)
		return 0, nil
	}
	if !podReady(launcher) {
		if unschedulable(launcher) {
			if d := m.wait(key, "unschedulable", migrationUnschedulableTimeout); d > 0 {
				return d, nil
			}
			return 0, m.fail(ctx, mig, vmi, "target virt-launcher pod "+launcher.Name+" unschedulable past the pending timeout")
		}
		return 0, nil // the pod's events bring the next pass
	}
	if len(hotplugOf(vmi)) == 0 {
		return 0, m.setPhase(ctx, mig, kubevirtv1.MigrationScheduling)
	}
	return m.ensureTargetAttachmentPod(ctx, key, mig, vmi, launcher)
}

// targetLauncherManifest is the target virt-launcher pod as
// createTargetPod writes it (migration.go:907-933): the VMI's launcher
// manifest with a required pod anti-affinity to the VMI's own pods by
// hostname, which keeps it off the source node (:858-880), the
// migration's addedNodeSelector merged into its node selector, and the
// migration's label and annotation.
func targetLauncherManifest(mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance) *corev1.Pod {
	pod := launcherManifest(vmi)
	pod.Name, pod.GenerateName = "", "virt-launcher-"+vmi.Name+"-"
	pod.Labels[kubevirtv1.MigrationJobLabel] = string(mig.UID)
	pod.Annotations[kubevirtv1.MigrationJobNameAnnotation] = mig.Name
	maps.Copy(pod.Spec.NodeSelector, mig.Spec.AddedNodeSelector)
	term := corev1.PodAffinityTerm{
		LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{kubevirtv1.CreatedByLabel: string(vmi.UID)}},
		TopologyKey:   corev1.LabelHostname,
	}
	if pod.Spec.Affinity == nil {
		pod.Spec.Affinity = &corev1.Affinity{}
	}
	if pod.Spec.Affinity.PodAntiAffinity == nil {
		pod.Spec.Affinity.PodAntiAffinity = &corev1.PodAntiAffinity{}
	}
	aa := pod.Spec.Affinity.PodAntiAffinity
	aa.RequiredDuringSchedulingIgnoredDuringExecution = append(aa.RequiredDuringSchedulingIgnoredDuringExecution, term)
	return pod
}

func podReady(p *corev1.Pod) bool {
	if p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// unschedulable is isPodPendingUnschedulable (migration.go:1428-1442).
func unschedulable(p *corev1.Pod) bool {
	if p.Status.Phase != corev1.PodPending || p.DeletionTimestamp != nil {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return true
		}
	}
	return false
}

// awaitingPod reports whether a target pod this controller created for the
// migration (key, or key/launcher for the target virt-launcher pod) is not
// in the cache yet (given up on after 10 s).
func (m *migrationController) awaitingPod(key string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	at, ok := m.created[key]
	return ok && time.Since(at) < 10*time.Second
}

func (m *migrationController) noteCreated(key string) {
	m.mu.Lock()
	m.created[key] = time.Now()
	m.mu.Unlock()
}

func (m *migrationController) forget(key string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.created, key)
	delete(m.created, key+"/launcher")
	for k := range m.due {
		if strings.HasPrefix(k, key+"/") {
			delete(m.due, k)
		}
	}
}

// activeMigration is the UID of the migration the VMI is in, if any.
func activeMigration(vmi *kubevirtv1.VirtualMachineInstance) types.UID {
	if ms := vmi.Status.MigrationState; ms != nil && !ms.Completed && !ms.Failed {
		return ms.MigrationUID
	}
	return ""
}

func targetOf(vmi *kubevirtv1.VirtualMachineInstance) string {
	if ms := vmi.Status.MigrationState; ms != nil {
		return ms.TargetNode
	}
	return ""
}

// hotplugNames are the VMI's hotplug volumes: what a target attachment pod
// holds (pkg/controller GetHotplugVolumes).
func hotplugOf(vmi *kubevirtv1.VirtualMachineInstance) []hotVolume {
	var out []hotVolume
	for _, v := range vmi.Spec.Volumes {
		if isHotpluggable(v) {
			out = append(out, hotVolume{name: v.Name, claim: volumeClaim(v)})
		}
	}
	return out
}

// targetNode is the node the migration goes to: the hostname its
// addedNodeSelector asks for, else the next host node after the source.
func (m *migrationController) targetNode(mig *kubevirtv1.VirtualMachineInstanceMigration, source string) string {
	if n := mig.Spec.AddedNodeSelector[corev1.LabelHostname]; n != "" {
		return n
	}
	return nextHostNode(m.c.opts.NodeName, source)
}

// nextHostNode picks another host node for a migration without a node
// selector: the simulated host nodes are named <prefix><n> after
// Options.NodeName (harvester-node-0, -1, -2: a small Harvester cluster);
// the scheduler's choice is the next one.
func nextHostNode(first, source string) string {
	prefix := strings.TrimRight(first, "0123456789")
	var n int
	if _, err := fmt.Sscanf(strings.TrimPrefix(source, prefix), "%d", &n); err != nil || !strings.HasPrefix(source, prefix) {
		return first
	}
	return fmt.Sprintf("%s%d", prefix, (n+1)%3)
}

func labelsMigration(mig *kubevirtv1.VirtualMachineInstanceMigration) labels.Selector {
	return labels.SelectorFromSet(labels.Set{kubevirtv1.MigrationJobLabel: string(mig.UID)})
}

// targetPod is the migration's attachment pod, if the cache has it.
func (m *migrationController) targetPod(mig *kubevirtv1.VirtualMachineInstanceMigration) *corev1.Pod {
	return m.migrationPod(mig, valueAttachmentPod)
}

// targetLauncher is the migration's target virt-launcher pod, if the cache
// has it (only with Options.Kubelets).
func (m *migrationController) targetLauncher(mig *kubevirtv1.VirtualMachineInstanceMigration) *corev1.Pod {
	return m.migrationPod(mig, valueLauncherPod)
}

// migrationPod is the newest live pod of the migration of the kind
// (kubevirt.io label value) from the cache.
func (m *migrationController) migrationPod(mig *kubevirtv1.VirtualMachineInstanceMigration, kind string) *corev1.Pod {
	pods, _ := m.c.podLister.Pods(mig.Namespace).List(labelsMigration(mig))
	sortNewestFirst(pods)
	for _, p := range pods {
		if p.DeletionTimestamp == nil && p.Labels[labelAttachmentPod] == kind {
			return p
		}
	}
	return nil
}

// createTargetPod creates the attachment pod on the target node with the
// VMI's hotplug volumes of now (migration.go:1383-1425); a change of the set
// after this is not in it. With Options.Kubelets it is rendered for the
// target virt-launcher pod, which owns it and whose node it requires
// (RenderHotplugAttachmentPodTemplate); without, the VMI owns it and its
// node keeps it out of the VMI's pods until status.nodeName is the target.
func (m *migrationController) createTargetPod(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance, launcher *corev1.Pod) (*corev1.Pod, error) {
	hot := hotplugOf(vmi)
	pod := attachmentPod(vmi, hot, m.targetNode(mig, vmi.Status.NodeName), 0)
	if launcher != nil {
		// KubeVirt renders it as if no volume were mounted yet
		// (migration.go:1395-1397): every filesystem claim gets its mount.
		bare := vmi.DeepCopy()
		bare.Status.VolumeStatus = nil
		for i := range hot {
			hot[i].pvc = m.c.pvc(vmi.Namespace, hot[i].claim)
		}
		kubeletAttachmentPod(pod, bare, hot, launcher)
	}
	pod.Labels[kubevirtv1.MigrationJobLabel] = string(mig.UID)
	pod.Annotations[kubevirtv1.MigrationJobNameAnnotation] = mig.Name
	return m.c.kube.CoreV1().Pods(vmi.Namespace).Create(ctx, pod, metav1.CreateOptions{})
}

// handOff writes the VMI's migrationState for the target
// (migration.go:1150-1190): the nodes, the target pod, and the target
// attachment pod's UID when the VMI has hotplug volumes.
func (m *migrationController) handOff(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance) error {
	pod := m.targetPod(mig)
	if len(hotplugOf(vmi)) > 0 && pod == nil {
		return fmt.Errorf("target attachment pod not found") // migration.go:1186
	}
	target := m.targetNode(mig, vmi.Status.NodeName)
	targetPod := "virt-launcher-" + vmi.Name + "-" + string(mig.UID)[:5]
	if m.c.opts.Kubelets {
		l := m.targetLauncher(mig)
		if l == nil || l.Spec.NodeName == "" {
			return fmt.Errorf("target virt-launcher pod not found")
		}
		target, targetPod = l.Spec.NodeName, l.Name
	}
	return m.editVMI(ctx, vmi, func(st *kubevirtv1.VirtualMachineInstanceStatus) {
		st.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{
			MigrationUID: mig.UID, SourceNode: st.NodeName, TargetNode: target,
			TargetPod: targetPod,
			Mode:      kubevirtv1.MigrationPreCopy,
		}
		if pod != nil {
			st.MigrationState.TargetAttachmentPodUID = pod.UID
		}
	})
}

// complete is the target virt-handler's acknowledgement (endTimestamp,
// nodeName), which makes the target's attachment pods the VMI's, and the
// end of the source: its node's attachment pods go, and with
// Options.Kubelets its virt-launcher pod.
func (m *migrationController) complete(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	source := vmi.Status.NodeName
	sourceLauncher := m.c.launcherPod(vmi)
	if err := m.editVMI(ctx, vmi, func(st *kubevirtv1.VirtualMachineInstanceStatus) {
		now := metav1.Now()
		st.MigrationState.EndTimestamp = &now
		st.MigrationState.Completed = true
		st.MigrationState.TargetNodeDomainDetected = true
		st.MigrationState.TargetNodeDomainReadyTimestamp = &now
		st.NodeName = st.MigrationState.TargetNode
	}); err != nil {
		return err
	}
	pods, _ := m.c.podLister.Pods(vmi.Namespace).List(labels.SelectorFromSet(labels.Set{labelAttachmentPodVMI: vmi.Name}))
	for _, p := range pods {
		if p.Labels[labelAttachmentPod] != valueAttachmentPod || p.Spec.NodeName != source || p.DeletionTimestamp != nil {
			continue
		}
		if metav1.IsControlledBy(p, vmi) || (sourceLauncher != nil && metav1.IsControlledBy(p, sourceLauncher)) {
			if err := deleteAttachmentPod(ctx, m.c, p); err != nil {
				return err
			}
		}
	}
	if sourceLauncher != nil && sourceLauncher.Spec.NodeName == source {
		// The source virt-launcher exits once its domain has moved; the
		// pod goes here, as nothing else ends its hollow container.
		return deleteAttachmentPod(ctx, m.c, sourceLauncher)
	}
	return nil
}

// editVMI changes the VMI's status on a fresh read, retrying conflicts with
// the VMI controller's and virt-handler's writes.
func (m *migrationController) editVMI(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, f func(*kubevirtv1.VirtualMachineInstanceStatus)) error {
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		cur := &kubevirtv1.VirtualMachineInstance{}
		if err := m.c.kv.get(ctx, resVMIs, vmi.Namespace, vmi.Name, cur); err != nil {
			return err
		}
		f(&cur.Status)
		return m.c.kv.update(ctx, resVMIs, cur.Namespace, cur.Name, "status", cur, &kubevirtv1.VirtualMachineInstance{})
	})
}

func (m *migrationController) setPhase(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, phase kubevirtv1.VirtualMachineInstanceMigrationPhase) error {
	upd := mig.DeepCopy()
	upd.Status.Phase = phase
	upd.Status.PhaseTransitionTimestamps = append(upd.Status.PhaseTransitionTimestamps,
		kubevirtv1.VirtualMachineInstanceMigrationPhaseTransitionTimestamp{Phase: phase, PhaseTransitionTimestamp: metav1.Now()})
	err := m.c.kv.update(ctx, resMigrations, mig.Namespace, mig.Name, "status", upd, &kubevirtv1.VirtualMachineInstanceMigration{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// fail ends the migration Failed; a VMI it had handed off to the target
// gets its migrationState closed as failed (lifecycle.go:473-476).
func (m *migrationController) fail(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance, why string) error {
	m.c.log.Info("migration failed", "vm", mig.Namespace+"/"+mig.Spec.VMIName, "migration", mig.Name, "reason", why)
	if vmi != nil && activeMigration(vmi) == mig.UID {
		if err := m.editVMI(ctx, vmi, func(st *kubevirtv1.VirtualMachineInstanceStatus) {
			now := metav1.Now()
			st.MigrationState.EndTimestamp, st.MigrationState.Completed, st.MigrationState.Failed = &now, true, true
		}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	for _, pod := range []*corev1.Pod{m.targetPod(mig), m.targetLauncher(mig)} {
		if pod != nil && (vmi == nil || pod.Spec.NodeName != vmi.Status.NodeName) {
			if err := deleteAttachmentPod(ctx, m.c, pod); err != nil {
				return err
			}
		}
	}
	return m.setPhase(ctx, mig, kubevirtv1.MigrationFailed)
}

// Migrate starts a live migration of the VM's VMI the way Harvester does:
// a VirtualMachineInstanceMigration naming the VMI (toNode, when set, goes
// into its addedNodeSelector). It returns the migration's name.
func (s *Sim) Migrate(ctx context.Context, namespace, vm, toNode string) (string, error) {
	mig := &kubevirtv1.VirtualMachineInstanceMigration{
		TypeMeta:   metav1.TypeMeta{APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachineInstanceMigration"},
		ObjectMeta: metav1.ObjectMeta{GenerateName: vm + "-", Namespace: namespace},
		Spec:       kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: vm},
	}
	if toNode != "" {
		mig.Spec.AddedNodeSelector = map[string]string{corev1.LabelHostname: toNode}
	}
	out := &kubevirtv1.VirtualMachineInstanceMigration{}
	if err := s.c.kv.create(ctx, resMigrations, namespace, mig, out); err != nil {
		return "", err
	}
	return out.Name, nil
}

// Migration returns the migration from the simulator's cache.
func (s *Sim) Migration(namespace, name string) (*kubevirtv1.VirtualMachineInstanceMigration, bool) {
	m, ok := s.c.migration(namespace, name)
	if !ok {
		return nil, false
	}
	return m.DeepCopy(), true
}

// migration is the cached migration (shared: do not modify).
func (c *cluster) migration(namespace, name string) (*kubevirtv1.VirtualMachineInstanceMigration, bool) {
	obj, ok, _ := c.migInf.GetIndexer().GetByKey(namespace + "/" + name)
	if !ok {
		return nil, false
	}
	return obj.(*kubevirtv1.VirtualMachineInstanceMigration), true
}

// HoldMigration keeps the VM's migration in phase Running (transferring)
// until released: a guest that dirties memory faster than it is copied.
func (f *Faults) HoldMigration(namespace, vm string, on bool) {
	f.holdMigration(namespace+"/"+vm, on)
}

// IsMigrating reports whether KubeVirt counts the VMI as migrating
// (pkg/util/migrations IsMigrating).
func IsMigrating(vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi != nil && isMigrating(vmi) }
