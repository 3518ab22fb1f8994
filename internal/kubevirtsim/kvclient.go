package kubevirtsim

import (
	"context"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Resource names of the kubevirt.io/v1 API.
const (
	resVMs       = "virtualmachines"
	resVMIs      = "virtualmachineinstances"
	resKubeVirts = "kubevirts"
)

// kvClient is a small typed client for kubevirt.io/v1 built on the REST
// client, so the simulator needs nothing beyond kubevirt.io/api.
type kvClient struct {
	rc     rest.Interface
	params runtime.ParameterCodec
}

func newKVClient(cfg *rest.Config) (*kvClient, error) {
	scheme := runtime.NewScheme()
	if err := kubevirtv1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	c := rest.CopyConfig(cfg)
	c.GroupVersion = &kubevirtv1.GroupVersion
	c.APIPath = "/apis"
	c.ContentType = runtime.ContentTypeJSON
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	if c.UserAgent == "" {
		c.UserAgent = "kubevirtsim"
	}
	rc, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, err
	}
	return &kvClient{rc: rc, params: runtime.NewParameterCodec(scheme)}, nil
}

func (c *kvClient) get(ctx context.Context, resource, ns, name string, into runtime.Object) error {
	return c.rc.Get().Namespace(ns).Resource(resource).Name(name).Do(ctx).Into(into)
}

func (c *kvClient) create(ctx context.Context, resource, ns string, obj, into runtime.Object) error {
	return c.rc.Post().Namespace(ns).Resource(resource).Body(obj).Do(ctx).Into(into)
}

// update PUTs obj (its resourceVersion is the precondition); subresource may
// be "" or "status".
func (c *kvClient) update(ctx context.Context, resource, ns, name, subresource string, obj, into runtime.Object) error {
	r := c.rc.Put().Namespace(ns).Resource(resource).Name(name)
	if subresource != "" {
		r = r.SubResource(subresource)
	}
	return r.Body(obj).Do(ctx).Into(into)
}

func (c *kvClient) patch(ctx context.Context, resource, ns, name, subresource string, pt types.PatchType, data []byte, dryRun []string, into runtime.Object) error {
	r := c.rc.Patch(pt).Namespace(ns).Resource(resource).Name(name)
	if subresource != "" {
		r = r.SubResource(subresource)
	}
	for _, d := range dryRun {
		r = r.Param("dryRun", d)
	}
	return r.Body(data).Do(ctx).Into(into)
}

func (c *kvClient) delete(ctx context.Context, resource, ns, name string, opts metav1.DeleteOptions) error {
	return c.rc.Delete().Namespace(ns).Resource(resource).Name(name).Body(&opts).Do(ctx).Error()
}

// informer returns a shared informer for a namespaced kubevirt.io resource
// (ns "" = all namespaces).
func (c *kvClient) informer(resource, ns string, obj, list runtime.Object) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			into := list.DeepCopyObject()
			err := c.rc.Get().Namespace(ns).Resource(resource).VersionedParams(&opts, c.params).Do(ctx).Into(into)
			return into, err
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.Watch = true
			var timeout time.Duration
			if opts.TimeoutSeconds != nil {
				timeout = time.Duration(*opts.TimeoutSeconds) * time.Second
			}
			return c.rc.Get().Namespace(ns).Resource(resource).VersionedParams(&opts, c.params).Timeout(timeout).Watch(ctx)
		},
	}
	return cache.NewSharedIndexInformer(lw, obj, 0, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
}
