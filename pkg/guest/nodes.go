// Package guest is the controller's view of the guest cluster it serves: its
// Nodes and CSINodes (which guest Node runs on which VM, and which volumes
// each guest still uses), the detach guard that keeps a volume on its VM
// while the guest still uses it, and the guest node monitor that fences the
// Nodes of VMs that stopped.
package guest

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// Load builds a client for the guest cluster: from a kubeconfig file when
// path is set, else from the pod's in-cluster configuration (the chart's
// controller pod runs in the guest cluster).
func Load(path string, qps float32, burst int) (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if path != "" {
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("guest kubeconfig: %w", err)
		}
		cfg, err = clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
			&clientcmd.ClientConfigLoadingRules{ExplicitPath: path}, &clientcmd.ConfigOverrides{}).ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("guest kubeconfig %s: %w", path, err)
		}
	} else if cfg, err = rest.InClusterConfig(); err != nil {
		return nil, fmt.Errorf("guest cluster: not in a pod and no --guest-kubeconfig: %w", err)
	}
	cfg.QPS, cfg.Burst = qps, burst
	return kubernetes.NewForConfig(cfg)
}

const (
	indexNodeID      = "driverNodeID"
	indexVolumeInUse = "volumeInUse"
	indexProviderID  = "providerID"
	indexAttachedVM  = "attachedVM"
)

// AttachedNodeIDAnnotation is where the external-attacher records on a
// VolumeAttachment the CSI node ID it attached to (external-attacher v4.12.0
// pkg/controller/util.go, vaNodeIDAnnotation), so that it can still detach
// once the CSINode lost the driver; here it maps a guest Node to its VM by
// the same record.
const AttachedNodeIDAnnotation = "csi.alpha.kubernetes.io/node-id"

// ProviderIDPrefix starts the spec.providerID that Harvester's cloud
// provider gives a guest Node: "harvester://" and the UID of its VM
// (harvester-cloud-provider v0.2.4 pkg/cloud-controller-manager/instance.go,
// InstanceMetadata).
const ProviderIDPrefix = "harvester://"

// VMUIDs tells the UID of a host VM, for the providerID mapping.
type VMUIDs func(vm string) (types.UID, bool)

// Nodes caches the guest cluster's Nodes, CSINodes, this driver's
// VolumeAttachments and the PersistentVolumes (which host PVCs are this
// cluster's, and their claims), once for every reader. A CSI node ID is the
// name of the guest's VM; the guest Node name may differ. The guest's
// CSINode (written by the node-driver-registrar) maps one to the other while
// the node plugin is registered; the mappings that outlive the plugin (the
// VolumeAttachments' node ID record, the Node's providerID, the last CSINode
// mapping seen) back it up, because kubelet drops the driver from the
// CSINode exactly while the node plugin restarts.
type Nodes struct {
	driver   string
	client   kubernetes.Interface
	factory  informers.SharedInformerFactory
	nodes    cache.SharedIndexInformer
	csiNodes cache.SharedIndexInformer
	vas      cache.SharedIndexInformer
	pvs      cache.SharedIndexInformer

	vmUIDs atomic.Pointer[VMUIDs]

	mu sync.Mutex
	// lastVM is the last node ID each CSINode gave this driver in this
	// process, kept when the registration goes away.
	lastVM map[string]string
}

// NewNodes builds the caches; Start runs them. resync re-delivers every
// Node to handlers that periodically, so a decision that depends on the
// host side too is taken again.
func NewNodes(client kubernetes.Interface, driverName string, resync time.Duration) (*Nodes, error) {
	f := informers.NewSharedInformerFactory(client, resync)
	n := &Nodes{driver: driverName, client: client, factory: f, nodes: f.Core().V1().Nodes().Informer(),
		csiNodes: f.Storage().V1().CSINodes().Informer(), vas: f.Storage().V1().VolumeAttachments().Informer(),
		pvs: f.Core().V1().PersistentVolumes().Informer(), lastVM: map[string]string{}}
	if err := n.csiNodes.AddIndexers(cache.Indexers{indexNodeID: func(obj any) ([]string, error) {
		cn, ok := obj.(*storagev1.CSINode)
		if !ok {
			return nil, nil
		}
		if id := driverNodeID(cn, driverName); id != "" {
			return []string{id}, nil
		}
		return nil, nil
	}}); err != nil {
		return nil, err
	}
	if err := n.nodes.AddIndexers(cache.Indexers{indexVolumeInUse: n.volumesInUseIndex, indexProviderID: providerIDIndex}); err != nil {
		return nil, err
	}
	if err := n.vas.SetTransform(trimAttachment); err != nil {
		return nil, err
	}
	if err := n.vas.AddIndexers(cache.Indexers{indexAttachedVM: n.attachedVMIndex}); err != nil {
		return nil, err
	}
	if err := n.pvs.SetTransform(trimPV); err != nil {
		return nil, err
	}
	if err := n.pvs.AddIndexers(cache.Indexers{indexPVHandle: n.pvHandleIndex}); err != nil {
		return nil, err
	}
	if _, err := n.csiNodes.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    n.remember,
		UpdateFunc: func(_, obj any) { n.remember(obj) },
	}); err != nil {
		return nil, err
	}
	// A Node that is deleted takes its mapping along: a new Node of that
	// name may run another VM.
	if _, err := n.nodes.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: n.forget}); err != nil {
		return nil, err
	}
	return n, nil
}

// volumesInUseIndex indexes a Node by the volumes of this driver it lists in
// status.volumesInUse, so that the guard finds the Nodes using a volume
// without scanning every Node.
func (n *Nodes) volumesInUseIndex(obj any) ([]string, error) {
	node, ok := obj.(*corev1.Node)
	if !ok {
		return nil, nil
	}
	prefix := string(UniqueVolumeName(n.driver, ""))
	var out []string
	for _, v := range node.Status.VolumesInUse {
		if strings.HasPrefix(string(v), prefix) {
			out = append(out, string(v))
		}
	}
	return out, nil
}

func providerIDIndex(obj any) ([]string, error) {
	node, ok := obj.(*corev1.Node)
	if !ok || !strings.HasPrefix(node.Spec.ProviderID, ProviderIDPrefix) {
		return nil, nil
	}
	return []string{node.Spec.ProviderID}, nil
}

// attachedVMIndex indexes this driver's VolumeAttachments by the node ID
// (VM) the external-attacher recorded on them.
func (n *Nodes) attachedVMIndex(obj any) ([]string, error) {
	va, ok := obj.(*storagev1.VolumeAttachment)
	if !ok || va.Spec.Attacher != n.driver {
		return nil, nil
	}
	if id := va.Annotations[AttachedNodeIDAnnotation]; id != "" {
		return []string{id}, nil
	}
	return nil, nil
}

// remember keeps the CSINode's mapping for when the registration is gone.
func (n *Nodes) remember(obj any) {
	cn, ok := obj.(*storagev1.CSINode)
	if !ok {
		return
	}
	if id := driverNodeID(cn, n.driver); id != "" {
		n.mu.Lock()
		n.lastVM[cn.Name] = id
		n.mu.Unlock()
	}
}

func (n *Nodes) forget(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	if node, ok := obj.(*corev1.Node); ok {
		n.mu.Lock()
		delete(n.lastVM, node.Name)
		n.mu.Unlock()
	}
}

// SetVMUIDs lets the Nodes of a VM be found by their providerID too.
func (n *Nodes) SetVMUIDs(f VMUIDs) { n.vmUIDs.Store(&f) }

// Start runs the informers until stop is closed.
func (n *Nodes) Start(stop <-chan struct{}) { n.factory.Start(stop) }

// HasSynced reports whether the Node, CSINode and VolumeAttachment caches
// have been filled (the PVs: PVsSynced).
func (n *Nodes) HasSynced() bool {
	return n.nodes.HasSynced() && n.csiNodes.HasSynced() && n.vas.HasSynced()
}

// AddNodeHandler registers h for Node events.
func (n *Nodes) AddNodeHandler(h cache.ResourceEventHandler) error {
	_, err := n.nodes.AddEventHandler(h)
	return err
}

// Node returns the cached guest Node of that name.
func (n *Nodes) Node(name string) (*corev1.Node, bool) {
	obj, ok, _ := n.nodes.GetStore().GetByKey(name)
	if !ok {
		return nil, false
	}
	node, ok := obj.(*corev1.Node)
	return node, ok
}

// AttachmentInformer is the cache of the guest's VolumeAttachments, for the
// controller's other readers (RWX exports) to share; they add their indexes
// before Start.
func (n *Nodes) AttachmentInformer() cache.SharedIndexInformer { return n.vas }

// trimAttachment keeps what the guard, the node mapping and the RWX export
// decision read of a VolumeAttachment: every one of the guest's stays in
// memory.
func trimAttachment(obj any) (any, error) {
	va, ok := obj.(*storagev1.VolumeAttachment)
	if !ok {
		return obj, nil
	}
	out := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: va.Name, UID: va.UID, ResourceVersion: va.ResourceVersion, DeletionTimestamp: va.DeletionTimestamp,
			CreationTimestamp: va.CreationTimestamp},
		Spec:   va.Spec,
		Status: storagev1.VolumeAttachmentStatus{Attached: va.Status.Attached},
	}
	if id := va.Annotations[AttachedNodeIDAnnotation]; id != "" {
		out.Annotations = map[string]string{AttachedNodeIDAnnotation: id}
	}
	return out, nil
}

// Attachment returns the cached VolumeAttachment of that name.
func (n *Nodes) Attachment(name string) (*storagev1.VolumeAttachment, bool) {
	obj, ok, _ := n.vas.GetStore().GetByKey(name)
	if !ok {
		return nil, false
	}
	va, ok := obj.(*storagev1.VolumeAttachment)
	return va, ok
}

// NodesOfVM returns the guest Nodes that run on VM vm: those whose CSINode
// gives this driver that node ID, whose VolumeAttachments of this driver
// record it, whose providerID names the VM's UID, or whose CSINode gave it
// when last seen in this process, unless their CSINode now names another
// VM; when none does, the Node named after the VM unless it is known to run
// another VM (upstream assumes Node name and VM name are equal). Usually one
// Node; a renamed guest can leave a second one behind until it is deleted.
func (n *Nodes) NodesOfVM(vm string) []*corev1.Node {
	names := map[string]bool{}
	objs, _ := n.csiNodes.GetIndexer().ByIndex(indexNodeID, vm)
	for _, o := range objs {
		if cn, ok := o.(*storagev1.CSINode); ok {
			names[cn.Name] = true
		}
	}
	for _, name := range n.lastNodesOf(vm) {
		names[name] = true
	}
	for _, va := range n.attachmentsOfVM(vm) {
		names[va.Spec.NodeName] = true
	}
	for _, node := range n.nodesByProviderID(vm) {
		names[node.Name] = true
	}
	for name := range names {
		if id := n.nodeID(name); id != "" && id != vm {
			delete(names, name)
		}
	}
	if len(names) == 0 {
		if id := n.knownVM(vm); (id == "" || id == vm) && !n.runsOtherVM(vm, vm) {
			names[vm] = true
		}
	}
	var out []*corev1.Node
	for _, name := range slices.Sorted(maps.Keys(names)) {
		if node, ok := n.Node(name); ok {
			out = append(out, node)
		}
	}
	return out
}

// runsOtherVM reports whether the guest Node of that name says, through
// Harvester's providerID, that it runs a VM other than vm: another UID, or
// any UID while vm's is unknown. Another guest cluster may share the host
// namespace (harvester/harvester#10906), and a Node of this cluster that
// only shares its name with a VM there must not be taken for that VM's.
func (n *Nodes) runsOtherVM(node, vm string) bool {
	obj, ok, _ := n.nodes.GetStore().GetByKey(node)
	if !ok {
		return false
	}
	nd, ok := obj.(*corev1.Node)
	if !ok || !strings.HasPrefix(nd.Spec.ProviderID, ProviderIDPrefix) {
		return false
	}
	f := n.vmUIDs.Load()
	if f == nil {
		return true
	}
	uid, ok := (*f)(vm)
	return !ok || ProviderIDPrefix+string(uid) != nd.Spec.ProviderID
}

func (n *Nodes) lastNodesOf(vm string) []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []string
	for node, id := range n.lastVM {
		if id == vm {
			out = append(out, node)
		}
	}
	return out
}

// attachmentsOfVM lists this driver's VolumeAttachments recorded as
// attached to vm.
func (n *Nodes) attachmentsOfVM(vm string) []*storagev1.VolumeAttachment {
	objs, _ := n.vas.GetIndexer().ByIndex(indexAttachedVM, vm)
	out := make([]*storagev1.VolumeAttachment, 0, len(objs))
	for _, o := range objs {
		if va, ok := o.(*storagev1.VolumeAttachment); ok {
			out = append(out, va)
		}
	}
	return out
}

func (n *Nodes) nodesByProviderID(vm string) []*corev1.Node {
	f := n.vmUIDs.Load()
	if f == nil {
		return nil
	}
	uid, ok := (*f)(vm)
	if !ok || uid == "" {
		return nil
	}
	objs, _ := n.nodes.GetIndexer().ByIndex(indexProviderID, ProviderIDPrefix+string(uid))
	out := make([]*corev1.Node, 0, len(objs))
	for _, o := range objs {
		if node, ok := o.(*corev1.Node); ok {
			out = append(out, node)
		}
	}
	return out
}

// NodesUsing returns the guest Nodes that list the volume in
// status.volumesInUse, from an index of the cache.
func (n *Nodes) NodesUsing(volumeID string) []*corev1.Node {
	objs, _ := n.nodes.GetIndexer().ByIndex(indexVolumeInUse, string(UniqueVolumeName(n.driver, volumeID)))
	out := make([]*corev1.Node, 0, len(objs))
	for _, o := range objs {
		if node, ok := o.(*corev1.Node); ok {
			out = append(out, node)
		}
	}
	slices.SortFunc(out, func(a, b *corev1.Node) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// DetachRequested returns when the detach of the volume from vm was asked
// for: the earliest deletion time among the volume's VolumeAttachments on
// vm (the attach/detach controller deletes a VolumeAttachment to detach, and
// the external-attacher's finalizer keeps it until ControllerUnpublish
// succeeds). nodes are guest Nodes of vm whose VolumeAttachment may lack the
// attacher's node ID record. False when none is being deleted.
func (n *Nodes) DetachRequested(vm, volumeID string, nodes []string) (time.Time, bool) {
	var since time.Time
	consider := func(va *storagev1.VolumeAttachment) {
		if va.DeletionTimestamp == nil || va.Spec.Attacher != n.driver || va.Name != AttachmentName(volumeID, n.driver, va.Spec.NodeName) {
			return
		}
		if id := va.Annotations[AttachedNodeIDAnnotation]; id != "" && id != vm {
			return
		}
		if t := va.DeletionTimestamp.Time; since.IsZero() || t.Before(since) {
			since = t
		}
	}
	for _, va := range n.attachmentsOfVM(vm) {
		consider(va)
	}
	for _, node := range nodes {
		if va, ok := n.Attachment(AttachmentName(volumeID, n.driver, node)); ok {
			consider(va)
		}
	}
	return since, !since.IsZero()
}

// VMOfNode is the VM a guest Node runs on: the node ID its CSINode gives this
// driver, else the one it gave when last seen in this process, else (no
// registration seen) the Node's own name, as upstream.
func (n *Nodes) VMOfNode(node string) string {
	if id := n.knownVM(node); id != "" {
		return id
	}
	return node
}

// knownVM is the node ID the CSINode of that name gives this driver now, or
// gave when last seen ("" if neither).
func (n *Nodes) knownVM(node string) string {
	if id := n.nodeID(node); id != "" {
		return id
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.lastVM[node]
}

// nodeID is this driver's node ID in the CSINode of that name ("" if none).
func (n *Nodes) nodeID(node string) string {
	obj, ok, _ := n.csiNodes.GetStore().GetByKey(node)
	if !ok {
		return ""
	}
	cn, ok := obj.(*storagev1.CSINode)
	if !ok {
		return ""
	}
	return driverNodeID(cn, n.driver)
}

func driverNodeID(cn *storagev1.CSINode, driver string) string {
	for _, d := range cn.Spec.Drivers {
		if d.Name == driver {
			return d.NodeID
		}
	}
	return ""
}

// UniqueVolumeName is how kubelet lists a CSI volume in a Node's
// status.volumesInUse and volumesAttached.
func UniqueVolumeName(driver, volumeID string) corev1.UniqueVolumeName {
	return corev1.UniqueVolumeName("kubernetes.io/csi/" + driver + "^" + volumeID)
}

// inUse reports whether the guest Node lists the volume in
// status.volumesInUse. Kubelet lists a volume there from the moment a pod on
// the Node wants it, before it is mounted, until it is unmounted from the
// device (NodeUnstage done), so a listed volume is either mounted or awaited.
func inUse(node *corev1.Node, driver, volumeID string) bool {
	return slices.Contains(node.Status.VolumesInUse, UniqueVolumeName(driver, volumeID))
}

// reportedAttached reports whether the guest Node's status.volumesAttached,
// written by the attach/detach controller, lists the volume.
func reportedAttached(node *corev1.Node, driver, volumeID string) bool {
	name := UniqueVolumeName(driver, volumeID)
	return slices.ContainsFunc(node.Status.VolumesAttached, func(a corev1.AttachedVolume) bool { return a.Name == name })
}

// mayBeMounted reports whether kubelet on the guest Node may have the volume
// mounted. Listed in volumesInUse is not enough: kubelet lists a volume a new
// pod waits for too. What separates the two is Kubernetes' own handshake
// (kubernetes v1.35.4, pkg/volume/util/operationexecutor/operation_generator.go,
// GenerateVerifyControllerAttachedVolumeFunc and verifyVolumeIsSafeToDetach;
// pkg/controller/volume/attachdetach/reconciler/reconciler.go, reconcile):
// kubelet mounts a volume only after reporting it in use and then reading it
// in volumesAttached from the API server, and the attach/detach controller
// takes a volume out of volumesAttached before it reads volumesInUse from
// the API server and detaches. So while a Ready Node lists the volume in use
// but no longer as attached, its kubelet is waiting for the volume to come
// back and cannot mount it: unplugging is what lets the re-attach go on
// (holding it would stall the pod for the whole guard timeout). A Node that
// is not Ready reports nothing fresh: its listing may be a mount the kubelet
// still has.
func mayBeMounted(node *corev1.Node, driver, volumeID string) bool {
	if !inUse(node, driver, volumeID) {
		return false
	}
	ready, _ := nodeReady(node)
	return reportedAttached(node, driver, volumeID) || !ready
}
