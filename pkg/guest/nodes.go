// Package guest is the controller's view of the guest cluster it serves: its
// Nodes and CSINodes (which guest Node runs on which VM, and which volumes
// each guest still uses), the detach guard that keeps a volume on its VM
// while the guest still uses it, and the guest node monitor that fences the
// Nodes of VMs that stopped.
package guest

import (
	"fmt"
	"os"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
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

const indexNodeID = "driverNodeID"

// Nodes caches the guest cluster's Nodes and CSINodes. A CSI node ID is the
// name of the guest's VM; the guest Node name may differ, and the guest's
// CSINode (written by the node-driver-registrar) maps one to the other.
type Nodes struct {
	driver   string
	client   kubernetes.Interface
	factory  informers.SharedInformerFactory
	nodes    cache.SharedIndexInformer
	csiNodes cache.SharedIndexInformer
}

// NewNodes builds the caches; Start runs them. resync re-delivers every
// Node to handlers that periodically, so a decision that depends on the
// host side too is taken again.
func NewNodes(client kubernetes.Interface, driverName string, resync time.Duration) (*Nodes, error) {
	f := informers.NewSharedInformerFactory(client, resync)
	n := &Nodes{driver: driverName, client: client, factory: f, nodes: f.Core().V1().Nodes().Informer(), csiNodes: f.Storage().V1().CSINodes().Informer()}
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
	return n, nil
}

// Start runs the informers until stop is closed.
func (n *Nodes) Start(stop <-chan struct{}) { n.factory.Start(stop) }

// HasSynced reports whether both caches have been filled.
func (n *Nodes) HasSynced() bool { return n.nodes.HasSynced() && n.csiNodes.HasSynced() }

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

// NodesOfVM returns the guest Nodes that run on VM vm: those whose CSINode
// gives this driver that node ID, or, when no CSINode does, the Node named
// after the VM unless its CSINode names another VM (upstream assumes Node
// name and VM name are equal). Usually one Node; a renamed guest can leave a
// second one behind until it is deleted.
func (n *Nodes) NodesOfVM(vm string) []*corev1.Node {
	var names []string
	objs, _ := n.csiNodes.GetIndexer().ByIndex(indexNodeID, vm)
	for _, o := range objs {
		if cn, ok := o.(*storagev1.CSINode); ok {
			names = append(names, cn.Name)
		}
	}
	if len(names) == 0 {
		if id := n.nodeID(vm); id == "" || id == vm {
			names = append(names, vm)
		}
	}
	slices.Sort(names)
	var out []*corev1.Node
	for _, name := range names {
		if node, ok := n.Node(name); ok {
			out = append(out, node)
		}
	}
	return out
}

// VMOfNode is the VM a guest Node runs on: the node ID its CSINode gives this
// driver, else (no registration yet) the Node's own name, as upstream.
func (n *Nodes) VMOfNode(node string) string {
	if id := n.nodeID(node); id != "" {
		return id
	}
	return node
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
